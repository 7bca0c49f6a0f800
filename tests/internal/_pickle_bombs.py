# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Hostile ``torch.save`` files built byte by byte, for the tests of the scan before loading
(``fairscale.internal.pickle_scan``) and of its callers (the consolidate tool, DCP's saved objects).

Other test folders put this one on ``sys.path`` to import it.
"""

import io
import zipfile

import torch


def with_data_pkl(data_pkl: bytes) -> bytes:
    """A real torch.save zip (of an empty dict) whose data.pkl is replaced by ``data_pkl``."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in source.infolist():
            z.writestr(info, data_pkl if info.filename.endswith("data.pkl") else source.read(info))
    return out.getvalue()


def hash_bomb(depth: int) -> bytes:
    """``{t: 1}`` with ``t = (t', t')`` shared at every one of ``depth`` levels through pickle's memo: about 1 KB for
    60 levels, and torch.load(weights_only=True) hashes ``2**depth`` tuples building the dict."""
    return with_data_pkl(b"\x80\x02)q\x00" + b"h\x00h\x00\x86q\x00" * depth + b"}h\x00K\x01s.")

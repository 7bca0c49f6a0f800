# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Exception types that are also ``AssertionError``, for checks that upstream wrote as ``assert``.

Upstream fairscale rejects much bad input with a bare ``assert``, so code written for it may catch
``AssertionError``. This distribution raises a clear type instead (``ValueError`` for a bad value,
``TypeError`` for a wrong type, ``RuntimeError`` for a call in the wrong state) with a message that says
what to change; raising one of the classes below keeps both kinds of callers working::

    try:
        unpack_kwargs(("a", "b"), (1,))
    except ValueError:       # new code
        ...
    except AssertionError:   # code written for upstream: still caught
        ...

Use them only where upstream asserted on the same condition; elsewhere raise the plain type.
"""

from typing import Any

__all__ = ["FairscaleValueError", "FairscaleTypeError", "FairscaleRuntimeError", "p_assert"]


class FairscaleValueError(ValueError, AssertionError):
    """A bad argument value (upstream: ``AssertionError``)."""


class FairscaleTypeError(TypeError, AssertionError):
    """An argument of the wrong type (upstream: ``AssertionError``)."""


class FairscaleRuntimeError(RuntimeError, AssertionError):
    """A call made in a state that does not allow it (upstream: ``AssertionError``)."""


def p_assert(cond: Any, s: Any) -> None:
    """Raise ``AssertionError(s)`` unless ``cond`` holds (upstream's helper, kept at its public paths).

    Unlike a bare ``assert`` it is not removed by ``python -O``, and the message travels with the exception (upstream
    printed it instead, because an error raised inside an autograd hook used to lose its message).

    Args:
        cond (Any): the condition, taken by its truth.
        s (Any): the message.
    """
    if not cond:
        raise AssertionError(s)

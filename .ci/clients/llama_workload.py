"""Client workload: the Llama 3 reference model of `llama-models` 0.3.0 on fairscale.nn.model_parallel, mp=1 vs mp=2.

Written for this repository's `clients` CI stage (.ci/clients/run); see docs/clients.rst. Run it with the python of
a venv that has llama-models 0.3.0 (without its `torch` extra, which pulls CUDA packages) and this repository.

`llama_models.llama3.model.Transformer` is Meta's reference implementation: it builds its attention and SwiGLU
projections from fairscale's ColumnParallelLinear / RowParallelLinear, the token embedding from
VocabParallelEmbedding (Llama 2 used ParallelEmbedding: the second variant below swaps it in), RMSNorm, rotary
embeddings, grouped-query attention and a KV cache, and asks fairscale.nn.model_parallel.initialize for the
model-parallel size. Its layers are built with an identity init_method: the weights come from a checkpoint.

So, as with real Llama checkpoints: a small model (2 layers, dim 64, 4 query heads sharing 2 KV heads, vocabulary
256) is built at mp=1 in a gloo world of 1, given seeded random weights and saved as one consolidated checkpoint;
the mp=2 run (2 gloo processes) builds the same model, cuts each weight into its rank's slice (column layers and
VocabParallelEmbedding: rows; row layers and ParallelEmbedding: columns) and loads it. Compared:
  1. logits of a full forward, mp=2 vs mp=1 (both ranks' replicated outputs);
  2. greedy decoding with the KV cache (prompt, then one token a step at its start_pos) vs a full forward of the
     decoded sequence: the logits at every decoded position, at mp=1 and at mp=2; and the decoded tokens,
     mp=2 vs mp=1.
Tolerance, from float32 reordering: mp=2 changes only the order of float32 sums (each RowParallelLinear adds two
half-length partial products; column layers and the embeddings are exact), so its error has the size of any other
summation order. That size is measured here: the mp=1 model with its FFN hidden units and its KV-head groups
permuted (the same function, other summation orders in wo and w2) gives the noise floor F = max|logits - logits of
the permuted model|; every comparison must stay within --factor * F (8 by default; a wrong slice, a missing
all-reduce or a stale cache entry is off by O(1), some 10^5 F). The decoded tokens must be equal.

Prints one result line per comparison, `llama: ... (ok)` or `(MISMATCH)`; exits non-zero on any mismatch.
"""

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, MULTIPLE_OF = 256, 64, 2, 4, 2, 32
BATCH, PROMPT, NEW = 2, 7, 9


def model_args():
    from llama_models.llama3.args import ModelArgs

    return ModelArgs(
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        vocab_size=VOCAB,
        multiple_of=MULTIPLE_OF,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_batch_size=BATCH,
        max_seq_len=32,
    )


def build(embedding: str) -> torch.nn.Module:
    from fairscale.nn.model_parallel.layers import ParallelEmbedding
    from llama_models.llama3.model import Transformer

    model = Transformer(model_args())
    if embedding == "ParallelEmbedding":  # Llama 2's token embedding: split along the embedding dimension
        model.tok_embeddings = ParallelEmbedding(VOCAB, DIM, init_method=lambda w: w)
    return model.eval()


def random_weights(model: torch.nn.Module) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name == "tok_embeddings.weight":
            state[name] = torch.randn(p.shape, generator=g)
        else:  # a linear layer's (out, in) weight
            state[name] = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
    return state


def permuted(state: dict) -> dict:
    """The same function with other float32 summation orders: FFN hidden units and KV-head groups permuted."""
    g = torch.Generator().manual_seed(1)
    state = dict(state)
    head_dim, rep = DIM // HEADS, HEADS // KV_HEADS
    kv_order = torch.randperm(KV_HEADS, generator=g)
    q_order = torch.cat([torch.arange(rep) + rep * int(k) for k in kv_order])  # query heads follow their KV head
    for layer in range(LAYERS):
        a, f = f"layers.{layer}.attention.", f"layers.{layer}.feed_forward."
        heads = lambda w, order: w.view(-1, head_dim, DIM)[order].reshape(-1, DIM)  # noqa: E731
        state[a + "wq.weight"] = heads(state[a + "wq.weight"], q_order)
        state[a + "wk.weight"] = heads(state[a + "wk.weight"], kv_order)
        state[a + "wv.weight"] = heads(state[a + "wv.weight"], kv_order)
        wo = state[a + "wo.weight"]
        state[a + "wo.weight"] = wo.view(DIM, HEADS, head_dim)[:, q_order].reshape(DIM, -1)
        hidden = torch.randperm(state[f + "w1.weight"].shape[0], generator=g)
        state[f + "w1.weight"] = state[f + "w1.weight"][hidden]
        state[f + "w3.weight"] = state[f + "w3.weight"][hidden]
        state[f + "w2.weight"] = state[f + "w2.weight"][:, hidden]
    return state


def shard(model: torch.nn.Module, full: dict, rank: int, world: int) -> dict:
    """This rank's slice of each weight of a consolidated checkpoint, by the fairscale layer that holds it."""
    from fairscale.nn.model_parallel.layers import (
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    out = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}" if module_name else name
            t = full[key]
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                t = t.chunk(world, dim=0)[rank]
            elif isinstance(module, (RowParallelLinear, ParallelEmbedding)):
                t = t.chunk(world, dim=1)[rank]
            assert t.shape == p.shape, (key, tuple(t.shape), tuple(p.shape))
            out[key] = t.contiguous().clone()
    return out


def run_model(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    logits = model(tokens, 0)  # the full forward of a fixed sequence
    # Greedy decoding with the KV cache: the prompt, then one token a step at its position.
    step = model(tokens[:, :PROMPT], 0)[:, -1]
    decoded, step_logits = [], []
    for i in range(NEW):
        step_logits.append(step)
        nxt = step.argmax(-1)
        decoded.append(nxt)
        if i + 1 < NEW:
            step = model(nxt[:, None], PROMPT + i)[:, -1]
    seq = torch.cat([tokens[:, :PROMPT], torch.stack(decoded, 1)], 1)
    # The same positions from a full forward of the decoded sequence (no cache reuse: start_pos 0).
    full_again = model(seq[:, :-1], 0)[:, PROMPT - 1 :]
    return {
        "logits": logits,
        "decoded": seq[:, PROMPT:],
        "step_logits": torch.stack(step_logits, 1),
        "refeed_logits": full_again,
    }


def worker(rank: int, world: int, init_file: str, workdir: str, job: str, embedding: str) -> None:
    from fairscale.nn.model_parallel.initialize import destroy_model_parallel, initialize_model_parallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + init_file, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=3)
    )
    try:
        initialize_model_parallel(world)
        torch.manual_seed(0)
        model = build(embedding)
        ckpt = os.path.join(workdir, "consolidated.pth")
        if job == "write":  # mp=1: make the consolidated checkpoint, then run it
            torch.save(random_weights(model), ckpt)
        full = torch.load(ckpt, weights_only=True)
        if job == "permuted":
            full = permuted(full)
        model.load_state_dict(shard(model, full, rank, world), strict=True)
        tokens = torch.randint(0, VOCAB, (BATCH, PROMPT + NEW), generator=torch.Generator().manual_seed(2))
        torch.save(run_model(model, tokens), os.path.join(workdir, f"{job}-{embedding}-rank{rank}.pt"))
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def launch(world: int, workdir: str, job: str, embedding: str) -> list:
    start = time.time()
    init_file = os.path.join(workdir, f"init-{job}-{embedding}")
    mp.spawn(worker, args=(world, init_file, workdir, job, embedding), nprocs=world, join=True)
    print(f"llama:   ({embedding}, mp={world}, {job}: {time.time() - start:.0f} s)", flush=True)
    return [torch.load(os.path.join(workdir, f"{job}-{embedding}-rank{r}.pt")) for r in range(world)]


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def check(embedding: str, workdir: str, factor: float) -> bool:
    (one,) = launch(1, workdir, "write", embedding)
    (perm,) = launch(1, workdir, "permuted", embedding)
    two = launch(2, workdir, "mp2", embedding)
    floor = maxdiff(one["logits"], perm["logits"])
    tol = factor * floor
    scale = one["logits"].abs().max().item()
    ok = True

    d_mp = max(maxdiff(r["logits"], one["logits"]) for r in two)
    d_ranks = maxdiff(two[0]["logits"], two[1]["logits"])
    good = d_mp <= tol and d_ranks == 0 and floor < 1e-4 * scale
    ok &= good
    print(
        f"llama: {embedding}: mp=2 vs mp=1 logits max|d| = {d_mp:.3g} (float32 reordering floor {floor:.3g}, "
        f"tol {tol:.3g}; |logits| up to {scale:.3g}; the 2 ranks' outputs differ by {d_ranks:.3g}) "
        f"({'ok' if good else 'MISMATCH'})",
        flush=True,
    )

    d_kv1 = maxdiff(one["step_logits"], one["refeed_logits"])
    d_kv2 = max(maxdiff(r["step_logits"], r["refeed_logits"]) for r in two)
    same_tokens = all(torch.equal(r["decoded"], one["decoded"]) for r in two)
    good = d_kv1 <= tol and d_kv2 <= tol and same_tokens
    ok &= good
    print(
        f"llama: {embedding}: KV-cache decoding ({NEW} tokens x {BATCH}) vs full forward max|d| = {d_kv1:.3g} "
        f"(mp=1), {d_kv2:.3g} (mp=2); decoded tokens mp=2 {'==' if same_tokens else '!='} mp=1 "
        f"({'ok' if good else 'MISMATCH'})",
        flush=True,
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=float, default=8.0, help="tolerance, in units of the measured noise floor")
    args = parser.parse_args()
    import fairscale.nn.model_parallel.layers  # noqa: F401  (fail here, loudly, if either package is missing)
    import llama_models.llama3.model as reference

    src = open(reference.__file__).read()
    assert "fairscale.nn.model_parallel" in src, "llama-models no longer builds on fairscale.nn.model_parallel"
    ok = True
    with tempfile.TemporaryDirectory(prefix="clients-llama-") as workdir:
        for embedding in ("VocabParallelEmbedding", "ParallelEmbedding"):
            sub = os.path.join(workdir, embedding)
            os.makedirs(sub)
            ok &= check(embedding, sub, args.factor)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

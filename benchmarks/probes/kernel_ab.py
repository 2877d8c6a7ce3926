"""Probe: the compiled kernels of another git revision against the working tree's, bit for bit and in time
(docs/benchmarks.md, "Verification cost T(n)").

    python benchmarks/probes/kernel_ab.py [--base HEAD~1] [--threads 2] [--flags=-mno-avx512f] [--model 3] [--cold]
        [--decode 12 [--drafters none,lookup]]

1. Attention (kernels/attention.c, speculate_attend): both builds on one grid of calls (head layouts of the default
   model, the Qwen pair and others; 1-33 new rows; no mask, causal and random masks; NaNs past the cache's length;
   1 and 2 threads): every output must be the same bits. Then their time, interleaved call by call. Both builds
   must take the paged cache (models/paged.py; kernel.pages lays the keys out): a base before it takes a contiguous
   cache and cannot be called so.
2. q4's matmul (kernels/blocks.c, speculate_block_matmul) on the default model's layer shapes, Q4_1 and Q8_0, and
   the Qwen 1.5B's MLP (gate/up Q4_K, down Q6_K): the same bits, and the time, interleaved.
3. With --model N: the default model at q4 through the lean decoder, N processes of each build alternating,
   T(1), T(8), T(16) after 200 and 800 tokens of context (the medians of 15 forwards), and a 1,000-token prefill
   (the median of 3).
4. With --decode N: greedy decoding of N MT-Bench chat prompts (128 new tokens) by the default model at q4 through
   the engine, in this one process, the two builds swapped per generation (their order alternating by prompt), so
   that the machine's drift between processes and rounds falls on both alike: the time per target call, what a
   decode step costs with the engine's own Python around the kernels (which the weights streaming through the
   caches slow too), as the median over prompts of base ÷ tree; both builds must give the same tokens.

--cold: the matmuls read each call's weights, and the attention calls their KV cache, from memory (copies past the
L3), as a decode step does; without it the weights of all but the largest layers, and the caches, stay in cache
between calls, and a change to how they stream in (asking for them ahead) does not show.

--flags=...: more compiler flags for both builds (``--flags=-mno-avx512f``: an AVX2 machine's code; add ``-mno-avx2 -mno-avx
-mno-fma`` for the scalar loops).
"""

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from speculate.models import kernel
from speculate.models.blocks import TYPES, BlockLinear

ROOT = Path(__file__).resolve().parents[2]
COLD = 96 << 20  # bytes of copies (weights, KV caches) a --cold call cycles through: beyond these machines' L3 (32 MB)
KERNELS = "src/speculate/models/kernels"


def build(folder: Path, flags: list[str]) -> ctypes.CDLL:
    out = folder / "kernels.so"
    sources = [str(folder / name) for name in kernel.SOURCES]
    subprocess.run(["cc", *kernel.FLAGS, "-fopenmp", *flags, "-o", str(out), *sources, "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    for name in ("speculate_attend", "speculate_block_matmul"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = kernel.SIGNATURES[name]
    if hasattr(lib, "speculate_amx_enable"):  # the tile path, as kernel.function turns it on (SPECULATE_NO_AMX: off)
        lib.speculate_amx_enable(kernel.amx_refused())
    return lib


def decode(libs, prompts: int, drafters: list[str], tokens: int = 128) -> None:
    """4. above: the builds swapped under one loaded model, per generation, as kernel.function hands them out."""
    from speculate import SpeculativeDecoder, SpeculativeSpec, load_model
    from speculate.bench.datasets import load_dataset
    from speculate.models.fast import lean_model

    tables = []
    for lib in libs:  # each build's functions, as kernel.function's table holds them
        table = {"lib": lib}
        for name, (restype, argtypes) in kernel.SIGNATURES.items():
            if hasattr(lib, name):
                table[name] = fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        tables.append(table)
    for name in kernel.SIGNATURES:  # a function one build lacks (new since the base): both run the other's
        for table, other in ((tables[0], tables[1]), (tables[1], tables[0])):
            if name not in table and name in other:
                print(f"{name}: only in one build; both run it")
                table[name] = other[name]
    kernel.function("speculate_decoder")  # (the package's own build, loaded first: the swaps below replace it)
    target = load_model("smollm2-135m-instruct", dtype="q4", progress=False)
    lean = lean_model(target)

    def use(i: int) -> None:
        kernel._loaded.clear()
        kernel._loaded.update(tables[i])
        lean.decoder = tables[i]["speculate_decoder"]  # (the one function the lean model keeps)

    samples = load_dataset("mt_bench", limit=prompts)
    decoders = {d: SpeculativeDecoder(target, SpeculativeSpec(d)) for d in drafters}
    for i in (0, 1):  # a first call's costs are not timed
        use(i)
        for dec in decoders.values():
            dec.generate("Hello there.", max_new_tokens=4)
    ratios = {d: [] for d in drafters}
    ms = {d: ([], []) for d in drafters}
    for j, sample in enumerate(samples):
        for d, dec in decoders.items():
            out = [None, None]
            for i in ((0, 1) if j % 2 == 0 else (1, 0)):
                use(i)
                start = time.perf_counter()
                gen = dec.generate(sample.turns[0], max_new_tokens=tokens)
                out[i] = (gen.token_ids, 1e3 * (time.perf_counter() - start) / gen.stats.target_calls)
            if out[0][0] != out[1][0]:
                raise SystemExit(f"{sample.id}, {d}: the builds decoded different tokens")
            ms[d][0].append(out[0][1])
            ms[d][1].append(out[1][1])
            ratios[d].append(out[0][1] / out[1][1])
    print(f"greedy decoding, {len(samples)} MT-Bench prompts x {tokens} tokens, the builds swapped per generation; "
          "ms per target call, medians; the same tokens")
    print("| drafter | base | tree | base ÷ tree (median of per-prompt ratios) | range |\n| --- | --- | --- | --- | --- |")
    for d in drafters:
        r = sorted(ratios[d])
        print(f"| {d} | {statistics.median(ms[d][0]):.2f} | {statistics.median(ms[d][1]):.2f} | "
              f"{statistics.median(r):.3f}x | {r[0]:.3f}-{r[-1]:.3f} |")


def sources(base: str, root: Path) -> tuple[Path, Path]:
    """The base revision's kernel sources and the working tree's, each in a folder of its own."""
    old, new = root / "base", root / "tree"
    for folder in (old, new):
        folder.mkdir()
    for name in kernel.SOURCES:
        text = subprocess.run(["git", "show", f"{base}:{KERNELS}/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (old / name).write_bytes(text)
        (new / name).write_bytes((ROOT / KERNELS / name).read_bytes())
    return old, new


def attention(libs) -> None:
    g = torch.Generator().manual_seed(0)
    cases = differ = 0
    for heads, kv_heads, d in ((9, 3, 64), (12, 2, 128), (14, 2, 64), (6, 2, 32), (8, 8, 128), (4, 1, 48)):
        for capacity in (64, 256, 1024):
            kt, v = torch.randn(kv_heads, d, capacity, generator=g), torch.randn(kv_heads, capacity, d, generator=g)
            for length in sorted({1, 5, 63, 64, 65, 150, capacity} & set(range(1, capacity + 1))):
                kt[..., length:], v[:, length:] = float("nan"), float("nan")  # never seen: must never count
                pages = kernel.pages(kt, v)
                for n in (1, 2, 3, 5, 9, 16, 33):
                    q = torch.randn(n, heads, d, generator=g) * 2
                    for kind in ("none", "causal", "random"):
                        mask = None
                        if kind != "none":
                            allowed = (torch.ones(n, length, dtype=torch.bool).tril_(length - n) if kind == "causal"
                                       else torch.rand(n, length, generator=g) < 0.5)
                            allowed[:, 0] = True
                            mask = kernel.mask(allowed)
                        for threads in (1, 2):
                            outs = []
                            for lib in libs:
                                out = torch.full((n, heads, d), 7.0)
                                rc = lib.speculate_attend(q.data_ptr(), pages[2], pages[3], 0, len(pages[2]),
                                                          None if mask is None else mask.data_ptr(), n, heads,
                                                          kv_heads, d, length, 0.125, out.data_ptr(), threads)
                                assert rc == 0, rc
                                outs.append(out.view(torch.int32))
                            cases += 1
                            differ += not torch.equal(*outs)
    print(f"attention: {cases} calls, {differ} with different bits")


def attention_time(libs, threads: int, cold: bool = False) -> None:
    capacity = 2048
    kt, v = torch.randn(3, 64, capacity), torch.randn(3, capacity, 64)
    # cold: each call reads the next of caches that together exceed COLD bytes (a decode step reads each layer's
    # cache once, with the weights and the other layers' caches between), as the matmuls below
    copies = [kernel.pages(kt, v) for _ in range(-(-COLD // (kt.numel() * 8)) if cold else 1)]
    calls = 0
    where = "caches from memory" if cold else "cache in cache"
    print(f"attention, the default model's heads (9 / 3 KV, d 64), {threads} threads, {where}, base / tree µs:")
    for context in (0, 200, 800, 1500):  # 0: a causal prefill of n rows
        cells = []
        for n in (1, 4, 8, 16, 64) if context else (128, 512, 1000):
            length = context + n
            mask = kernel.mask(torch.ones(n, length, dtype=torch.bool).tril(context)) if n > 1 else None
            q, out = torch.randn(n, 9, 64), torch.empty(n, 9, 64)
            times = [[], []]
            for _ in range(20):
                for lib, ts in zip(libs, times):
                    pages = copies[calls % len(copies)]
                    calls += 1
                    t = time.perf_counter()
                    lib.speculate_attend(q.data_ptr(), pages[2], pages[3], 0, len(pages[2]),
                                         None if mask is None else mask.data_ptr(), n, 9, 3, 64, length, 0.125,
                                         out.data_ptr(), threads)
                    ts.append(time.perf_counter() - t)
            a, b = (statistics.median(ts) * 1e6 for ts in times)
            cells.append(f"{n} rows {a:.0f} / {b:.0f} ({a / b:.2f}x)")
        print(f"  context {context}: " + " | ".join(cells))


def random_layer(kind: str, out: int, k: int) -> BlockLinear:
    number, elems, size = TYPES[kind]
    blocks = torch.randint(0, 256, (out, k // elems, size), dtype=torch.uint8)
    d = 208 if kind == "Q6_K" else 0  # where the block's fp16 scale sits
    blocks[..., d:d + 2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d = fp16 0x2000 (~0.008)
    if kind in ("Q4_1", "Q4_K"):
        blocks[..., 2:4] = torch.tensor([0x00, 0xa0], dtype=torch.uint8)  # m (Q4_K: dmin) = fp16 0xa000 (~-0.008)
    return BlockLinear(blocks.reshape(out, -1), kind, k)


def matmul(libs, threads: int, row_counts=(1, 2, 8, 16), cold: bool = False) -> None:
    where = "weights from memory" if cold else "weights in cache"
    print(f"q4 matmul (two activation rows a row), {threads} threads, {where}, base / tree µs:")
    torch.manual_seed(0)
    for kind, out, k in (("Q4_1", 960, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576),
                         ("Q4_K", 17920, 1536), ("Q6_K", 1536, 8960)):
        layer, number = random_layer(kind, out, k), TYPES[kind][0]
        # cold: every call reads the next of copies that together exceed COLD bytes, so its weights come from memory
        # as a decode step's do (a step reads each layer once); else one copy, warm in cache after the first call
        copies = [layer.packed0] + [layer.packed0.clone() for _ in range(-(-COLD // layer.packed0.numel()) - 1
                                                                         if cold else 0)]
        calls = 0
        cells = []
        for rows in row_counts:
            x = torch.randn(rows, k)
            ys = [torch.empty(rows, out) for _ in libs]
            times = [[], []]
            for _ in range(15):
                for lib, y, ts in zip(libs, ys, times):
                    w = copies[calls % len(copies)].data_ptr()
                    calls += 1
                    t = time.perf_counter()
                    lib.speculate_block_matmul(number, w, out, k, x.data_ptr(), rows, None, 0.0, 0, None, None,
                                               y.data_ptr(), out, threads, 2)
                    ts.append(time.perf_counter() - t)
            a, b = (statistics.median(ts) * 1e6 for ts in times)
            same = "" if torch.equal(ys[0].view(torch.int32), ys[1].view(torch.int32)) else " DIFFERENT BITS"
            cells.append(f"{rows} rows {a:.0f} / {b:.0f} ({a / b:.2f}x){same}")
        print(f"  {kind} {out}x{k}: " + " | ".join(cells))


MODEL = """
import sys, time, torch
from pathlib import Path
from speculate.models import kernel
kernel.KERNELS = Path(sys.argv[1])
from speculate.models.fast import FastKVModel
from speculate.models.loader import load_model
torch.set_num_threads(int(sys.argv[2]))
kv = FastKVModel(load_model("smollm2-135m-instruct", dtype="q4", progress=False))
out = []
for c in (200, 800):
    context = torch.randint(0, 40000, (c,), generator=torch.Generator().manual_seed(0))
    kv.reset(1024)
    kv.forward(context)
    for n in (1, 8, 16):
        ts = []
        for _ in range(15):
            kv.keep(c)
            t = time.perf_counter()
            kv.forward(context[:n])
            ts.append(time.perf_counter() - t)
        out.append(sorted(ts)[7] * 1e3)
prompt = torch.randint(0, 40000, (1000,), generator=torch.Generator().manual_seed(1))
ts = []
for _ in range(3):  # a 1,000-token prompt's prefill from an empty cache, in one forward
    kv.reset(1088)
    t = time.perf_counter()
    kv.forward(prompt, last=1)
    ts.append(time.perf_counter() - t)
out.append(sorted(ts)[1] * 1e3)
print(" ".join(f"{t:.2f}" for t in out))
"""


def model(folders, threads: int, rounds: int) -> None:
    results = {"base": [], "tree": []}
    for _ in range(rounds):
        for name, folder in zip(results, folders):
            line = subprocess.run([sys.executable, "-c", MODEL, str(folder), str(threads)], check=True,
                                  capture_output=True, text=True).stdout.split()
            results[name].append([float(x) for x in line])
    print(f"the default model at q4, {threads} threads, {rounds} processes each alternating; median ms:")
    print("| build | T(1) @200 | T(8) @200 | T(16) @200 | T(1) @800 | T(8) @800 | T(16) @800 | prefill 1000 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    med = {name: [statistics.median(col) for col in zip(*runs)] for name, runs in results.items()}
    for name, cols in med.items():
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")
    print("| base ÷ tree | " + " | ".join(f"{a / b:.2f}x" for a, b in zip(med["base"], med["tree"])) + " |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with (default HEAD~1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flags", default="", help="more compiler flags for both builds")
    parser.add_argument("--model", type=int, default=0, help="processes of each build for the model's T(n)")
    parser.add_argument("--decode", type=int, default=0, help="MT-Bench prompts decoded by each build (4. above)")
    parser.add_argument("--drafters", default="none,lookup", help="--decode's drafters")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16], help="the matmuls' row counts")
    parser.add_argument("--matmul-only", action="store_true", help="skip the attention calls (1.)")
    parser.add_argument("--cold", action="store_true",
                        help="the matmuls' weights and the attention's caches from memory, not from cache")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folders = sources(args.base, Path(tmp))
        libs = [build(folder, args.flags.split()) for folder in folders]
        print(f"base {args.base} against the working tree; extra flags: {args.flags or 'none'}")
        if args.decode:
            decode(libs, args.decode, args.drafters.split(","))
            return
        if not args.matmul_only:
            attention(libs)
            attention_time(libs, args.threads, args.cold)
        matmul(libs, args.threads, args.rows, args.cold)
        if args.model:
            model(folders, args.threads, args.model)


if __name__ == "__main__":
    main()

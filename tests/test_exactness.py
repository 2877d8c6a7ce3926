"""Batch invariance on the CPU that runs the tests: every op of the int8 forward gives a row the same bits alone
as with other rows (the attention kernel, its PyTorch fallback, the int8 layers, norms, element-wise ops), chains
and random trees equal one-token decoding, the load-time self-check can fail and its fallback stays exact, and
the whole file passes again under other ATen/MKL/fbgemm code paths (ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS, FBGEMM_ENABLE_INSTRUCTIONS).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.drafters import get_drafter
from speculate.errors import SpeculateWarning
from speculate.models import exact_attention, exactness, kernel
from speculate.models.fast import FastKVModel
from speculate.models.quantize import Int8Linear
from conftest import assert_chains_equal_one_token, assert_pytest_passed, noisy_copy, torch_threads

ROW_COUNTS = (2, 3, 5, 9, 16, 61)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(params=["kernel", "integer"])
def attention(request, monkeypatch):
    """Both exact attentions: the compiled kernel, and the PyTorch-ops fallback used where no compiler works."""
    if request.param == "integer":
        monkeypatch.setattr(kernel, "load", lambda: None)
    elif kernel.load() is None:
        pytest.skip("no C compiler here: the kernel cannot be built")
    return request.param


def attend_fn(kind, heads, kv_heads, d, capacity, keys, values):
    """(attend(q, allowed, length)) over keys/values [kv heads, length, d] written as the model writes them."""
    length = keys.shape[1]
    if kind == "kernel":
        kt = torch.zeros(kv_heads, d, capacity)
        vt = torch.zeros(kv_heads, capacity, d)
        kt[:, :, :length], vt[:, :length] = keys.transpose(1, 2), values
        fn = kernel.load()
        return lambda q, allowed, n_keys: kernel.attend(fn, q, kt, vt, kernel.mask(allowed), n_keys, 0.125)
    kc = torch.zeros(kv_heads, capacity, d + 1, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    exact_attention.write(kc, 0, keys.transpose(0, 1), exact_attention.B_K)
    exact_attention.write(vc, 0, values.transpose(0, 1), exact_attention.B_V)
    bits = exact_attention.budgets(d, 8192)
    return lambda q, allowed, n_keys: exact_attention.attend(q, kc[:, :n_keys], vc[:, :n_keys], allowed, 0.125, bits)


@pytest.mark.parametrize("d", [32, 64, 128])  # the kernel's generic loop and its two specialised ones
def test_attention_rows_do_not_depend_on_the_other_rows_or_the_key_layout(attention, d):
    """Each row of a batched call equals the row computed alone (same visible keys), for chains and random
    masks; and a row over keys with masked slots between them (a tree node and its siblings) equals the same
    keys packed contiguously (plain decoding's layout). Close to PyTorch's fused attention."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, length = 6, 2, 150
    keys, values = torch.randn(kv_heads, length, d, generator=g), torch.randn(kv_heads, length, d, generator=g)
    run = attend_fn(attention, heads, kv_heads, d, 256, keys, values)
    for n in ROW_COUNTS:
        q = torch.randn(n, heads, d, generator=g) * 2
        for allowed in (torch.ones(n, length, dtype=torch.bool).tril_(length - n),
                        torch.rand(n, length, generator=g) < 0.6):
            allowed[:, 0] = True
            batched = run(q, allowed, length)
            for j in range(n):
                assert torch.equal(batched[j: j + 1], run(q[j: j + 1], allowed[j: j + 1], length)), (n, j)
            reference = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.repeat_interleave(3, 0), values.repeat_interleave(3, 0),
                attn_mask=allowed, scale=0.125).transpose(0, 1).reshape(n, -1)
            torch.testing.assert_close(batched, reference, rtol=1e-4, atol=1e-4)
    # Layout: row sees slots `seen` among masked ones; packed, the same keys sit at 0..len(seen)-1.
    seen = sorted(random.Random(1).sample(range(length), 40))
    packed = attend_fn(attention, heads, kv_heads, d, 256, keys[:, seen], values[:, seen])
    q = torch.randn(1, heads, d, generator=g)
    allowed = torch.zeros(1, length, dtype=torch.bool)
    allowed[0, seen] = True
    assert torch.equal(run(q, allowed, length), packed(q, None, len(seen)))


def test_every_other_op_of_the_int8_forward_is_row_independent():
    """int8 layers (plain and with the residual), RMSNorm, SiLU·up, rotary, embedding: a row's bits alone = with
    others, for several row counts (the element-wise and row-wise kernels' vector/scalar split moves with n)."""
    g = torch.Generator().manual_seed(0)
    layer = Int8Linear.from_float(torch.randn(200, 96, generator=g), torch.randn(200, generator=g))
    norm_w, embed = torch.rand(96, generator=g) + 0.5, torch.randn(300, 96, generator=g)
    cos, sin = torch.randn(64, 1, 16, generator=g), torch.randn(64, 1, 16, generator=g)
    ops = {
        "int8 linear": lambda x: layer.matmul_2d(x),
        "int8 linear + residual": lambda x: layer.add_matmul_2d(x[:, :1].expand(-1, 200).contiguous(), x),
        "rms_norm": lambda x: F.rms_norm(x, (96,), norm_w, 1e-5),
        "silu * up": lambda x: F.silu(x[:, :48]).mul_(x[:, 48:]),
        "rotary": lambda x: torch.addcmul(x.view(-1, 6, 16) * cos[: x.shape[0]], x.view(-1, 6, 16).roll(8, -1),
                                          sin[: x.shape[0]]).reshape(x.shape[0], -1),
        "embedding": lambda x: F.embedding((x[:, 0].abs() * 50).long() % 300, embed),
    }
    for n in ROW_COUNTS:
        x = torch.randn(n, 96, generator=g) * 3
        for name, op in ops.items():
            batched = op(x)
            alone = torch.cat([op(x[j: j + 1]) for j in range(n)]) if name != "rotary" else \
                torch.cat([torch.addcmul(x[j: j + 1].view(1, 6, 16) * cos[j: j + 1], x[j: j + 1].view(1, 6, 16)
                                         .roll(8, -1), sin[j: j + 1]).reshape(1, -1) for j in range(n)])
            assert torch.equal(batched, alone), (name, n)


def test_rotary_rows_come_from_a_table_whose_rows_never_change(tiny):
    """LeanModel._rope: a position's cos and sin are rows of a table that the model's rotary module computed once for
    that position (the table grows by new positions only), so they are the same bits in every forward whatever other
    rows it holds, by construction; and they are cos and sin of the module's float32 angles."""
    from speculate.models.fast import lean_model

    lean = lean_model(tiny[0])
    lean._rope_table = None
    x = torch.zeros(3, lean.hidden_size, dtype=lean.dtype)
    first = lean._rope(x, torch.tensor([5, 0, 1000]))
    before = [t.clone() for t in lean._rope_table]
    assert before[0].shape[0] == 1024
    grown = lean._rope(x, torch.tensor([2500, 5, 0]))
    assert lean._rope_table[0].shape[0] == 4096  # (the next power of two)
    assert all(torch.equal(t[:1024], b) for t, b in zip(lean._rope_table, before))  # rows once made never change
    assert torch.equal(grown[0][1:], first[0][:2]) and torch.equal(grown[1][1:], first[1][:2])
    positions = torch.tensor([2500, 5, 0, 1000, 4095])
    cos, sin = lean._rope(x, positions)
    angles = (positions[:, None].float() * lean.rotary.inv_freq.float()).double()
    angles = torch.cat([angles, angles], dim=-1)  # (the module's halves, repeated)
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-6) and torch.allclose(sin.double(), angles.sin(), atol=1e-6)


def random_prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def test_int8_chains_and_random_trees_equal_one_token_decoding(tiny_folders, cache, attention):
    """Through the loaded int8 model (either exact attention): a prefill, chains across cache growth and
    rollbacks, and 6 random trees of 14 nodes give each row exactly what one token at a time gives."""
    loaded = load_model(str(tiny_folders[0]), dtype="int8")
    kv = FastKVModel(loaded)
    assert kv.attention == attention and not kv.row_by_row
    ids = torch.tensor(random_prompt(2, 140))
    assert_chains_equal_one_token(kv, ids)
    rng = random.Random(5)
    kv.keep(60)
    for _ in range(6):
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, 14)]
        tokens = torch.tensor([rng.randrange(3, 259) for _ in parents])
        kv.keep(60)
        tree = kv.forward(tokens, tree_parents=parents)
        for leaf in set(range(len(parents))) - set(parents):
            path = [leaf]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            kv.keep(60)
            assert torch.equal(tree[path], torch.cat([kv.forward(tokens[[t]]) for t in path])), (parents, path)


@pytest.mark.parametrize("dtype", ["fp32", "int8", "q4"])
def test_the_whole_forward_gives_each_row_the_same_bits_at_one_and_two_threads(tiny_folders, cache, dtype):
    """The whole forward at two threads (fp32 and q4: the decoder's one C call; int8: its per-layer kernels; the
    matmuls' outputs and the attention's heads split between threads) gives each row of a prefill, a chain and a tree
    the bits it gives at one. The suite's workers run torch at one thread each (conftest.py), so the split is tested
    here by name, on every precision the kernels run."""
    loaded = load_model(str(tiny_folders[0]), dtype=dtype)
    kv = FastKVModel(loaded)
    assert not kv.row_by_row
    ids = torch.tensor(random_prompt(3, 130))
    parents = [-1, 0, 0, 1, -1, 4, 2, 6]

    def rows():
        kv.reset(32)
        out = [kv.forward(ids[:100]), kv.forward(ids[100:109])]
        kv.keep(100)
        return out + [kv.forward(ids[110:118], tree_parents=parents)]

    with torch_threads(2):
        two = rows()
    with torch_threads(1):
        one = rows()
    assert [a.shape[0] for a in two] == [100, 9, 8]
    assert all(torch.equal(a, b) for a, b in zip(two, one))


def test_the_self_check_can_fail(tiny_folders, cache, monkeypatch):
    """A forward whose rows depend on the batch (attention output nudged by the row count) fails the check."""
    from speculate.models import kernel

    loaded = load_model(str(tiny_folders[1]), dtype="int8")
    kv = FastKVModel(loaded)
    assert kv.attention == "kernel" and exactness.rows_agree(kv)
    real = kernel.attention_many

    def nudged(qkv, *args):
        return real(qkv, *args) * (1 + 1e-6 * (qkv.shape[0] - 1))

    monkeypatch.setattr(kernel, "attention_many", nudged)
    assert not exactness.rows_agree(kv)


def test_a_failed_self_check_falls_back_to_exact_row_by_row_verification(tiny_folders, cache, monkeypatch):
    monkeypatch.setattr(exactness, "rows_agree", lambda kv: False)
    target = load_model(str(tiny_folders[0]), dtype="int8")
    with pytest.warns(SpeculateWarning, match="one at a time"):
        plain = SpeculativeDecoder(target, SpeculativeSpec("none"))
    assert plain.new_cache().row_by_row
    draft = noisy_copy(target, 0.05)
    accepted = 0
    for seed in range(3):
        prompt = random_prompt(seed, 6) * 4
        ref = plain.generate(prompt, max_new_tokens=40)
        assert ref.stats.exactness == "row-by-row"
        for drafter in (get_drafter("lookup"), get_drafter("model", draft, target)):
            out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=5),
                                     drafter=drafter).generate(prompt, max_new_tokens=40)
            assert out.token_ids == ref.token_ids, drafter.name
            accepted += out.stats.accepted_draft_tokens
    assert accepted > 0
    # A model with no batch-invariant path (bf16 without the kernel: PyTorch's matmuls and attention) claims none.
    monkeypatch.setenv("SPECULATE_NO_KERNEL", "1")
    bf16 = load_model(str(tiny_folders[0]), dtype="bf16")
    assert SpeculativeDecoder(bf16, SpeculativeSpec("none")).generate([5, 6, 7], max_new_tokens=2).stats.exactness == "none"
    monkeypatch.undo()
    fresh = load_model(str(tiny_folders[0]), dtype="int8")  # a new load: checked again, for real
    plain = SpeculativeDecoder(fresh, SpeculativeSpec("none"))
    assert plain.generate([5, 6, 7], max_new_tokens=2).stats.exactness == "batched"


@pytest.mark.skipif(os.environ.get("SPECULATE_OTHER_PATHS") == "1", reason="already the other code paths")
def test_the_same_holds_under_other_cpu_code_paths(tmp_path):
    """This file's tests again with ATen's AVX2 kernels, MKL limited to AVX2 (other blockings and vector
    widths than the default on an AVX-512 CPU) and fbgemm's pre-VNNI int8 kernels (7-bit activations:
    quantize.activation_levels), in a fresh process."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
           "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "SPECULATE_OTHER_PATHS": "1", "SPECULATE_CACHE": str(tmp_path)}
    here = Path(__file__).resolve()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here),
                           "-k", "not slow and not other_cpu_code_paths"], env=env, cwd=here.parent.parent,
                          capture_output=True, text=True, timeout=900)
    assert_pytest_passed(done)


@pytest.mark.slow
def test_default_model_int8_speculation_equals_plain_decoding_on_20_prompts(default_model):
    """The default model at int8, 20 held-out prompts (10 GSM8K test questions, 10 MT-Bench first turns, from
    the packaged data): lookup, retrieval and the shipped EAGLE tree give exactly plain int8 greedy decoding."""
    from speculate.bench.datasets import load_dataset

    target = load_model(dtype="int8")
    prompts = [[{"role": "user", "content": s.turns[0]}]
               for s in load_dataset("gsm8k", limit=10, shots=0) + load_dataset("mt_bench", limit=10)]
    plain = SpeculativeDecoder(target, SpeculativeSpec("none"))
    refs = [plain.generate(p, max_new_tokens=32) for p in prompts]
    assert refs[0].stats.exactness == "batched"
    for method in ("lookup", "retrieval", "eagle"):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(method, verifier="greedy", k=5))
        new = calls = 0
        for prompt, ref in zip(prompts, refs):
            out = decoder.generate(prompt, max_new_tokens=32)
            assert out.token_ids == ref.token_ids, (method, prompt[0]["content"][:60])
            new, calls = new + out.stats.new_tokens, calls + out.stats.target_calls
        assert new / calls > 1.1, (method, new / calls)  # the drafts were used

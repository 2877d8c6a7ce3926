"""Probe: the int8 matmul kernels this torch offers on CPU, per layer and for a whole decode step.

    python benchmarks/probes/int8_kernels.py [--threads 2]

Per layer shape of SmolLM2-135M (and one of Qwen-1.5B), microseconds per call at 1 and 8 rows (median):
  fbgemm   torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32 (what Int8Linear runs)
  onednn   torch.ops.onednn.qlinear_pointwise on a onednn-prepacked weight, activations quantized here
  int_mm   torch._int_mm (int8 x int8 -> int32) on the [out, in] weight's transposed view, activations
           quantized here (the int32 product is exact, so rows stay independent)
Then a whole SmolLM2 int8 decode step (FastKVModel, 200 cached tokens) at 1, 4 and 8 new tokens with the
layers of <= 2M weights on int_mm instead of fbgemm (a per-layer choice keeps batch invariance: each layer
runs one exact integer kernel whatever the row count). Results in docs/benchmarks.md, "Other int8 kernels".
"""

import argparse
import time
import warnings

import torch

warnings.simplefilter("ignore")


def median_us(fn, reps=300):
    for _ in range(20):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * sorted(ts)[len(ts) // 2]


def quantize_rows(x):
    r = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
    return (x * (127 / r)).round_().to(torch.int8), r


def layers():
    fbgemm = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
    print("| in -> out | rows | fbgemm | onednn | int_mm (+ quantize/rescale) |\n| --- | --- | --- | --- | --- |")
    for i, o in [(16, 16), (576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (1536, 8960)]:
        w = torch.randint(-127, 128, (o, i), dtype=torch.int8)
        s = torch.rand(o) * 0.01
        q = torch._make_per_channel_quantized_tensor(w, s.double(), torch.zeros(o, dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(q, None)
        onednn_w, zps = torch.ops.onednn.qlinear_prepack(w, None), torch.zeros(o, dtype=torch.long)
        for rows in (1, 8):
            x = torch.randn(rows, i)
            r = x.abs().amax(-1, keepdim=True)

            def onednn():
                qx = (x / r * 127).round_().add_(128).to(torch.uint8)
                return torch.ops.onednn.qlinear_pointwise(qx, 1 / 127, 128, onednn_w, s, zps, None, 1.0, 0,
                                                          torch.float32, "none", [], "")

            def int_mm():
                xq, rr = quantize_rows(x)
                return torch._int_mm(xq, w.t()).float().mul_(s).mul_(rr / 127)

            print(f"| {i} -> {o} | {rows} | {median_us(lambda: fbgemm(x / r, 1 / 127, 128, packed)):.0f} | "
                  f"{median_us(onednn):.0f} | {median_us(int_mm):.0f} |", flush=True)


def whole_step(limit=2_000_000):
    from speculate.models import load_model
    from speculate.models import quantize as Q
    from speculate.models.fast import FastKVModel

    m = load_model("smollm2-135m-instruct", dtype="int8")
    small = [layer for layer in m.model.modules() if isinstance(layer, Q.Int8Linear) and layer.out_features * layer.in_features <= limit]
    kernels = {id(layer): (layer.matmul_2d, layer.add_matmul_2d) for layer in small}
    weights = {id(layer): (layer.tensors()[0], layer.tensors()[1].float()) for layer in small}

    def on_int_mm(layer):
        w, s = weights[id(layer)]

        def matmul(x):
            xq, r = quantize_rows(x)
            y = torch._int_mm(xq, w.t()).float().mul_(s).mul_(r / 127)
            return y if layer.bias is None else y.add_(layer.bias)

        def add_matmul(residual, x):
            xq, r = quantize_rows(x)
            y = torch.addcmul(residual, torch._int_mm(xq, w.t()).float().mul_(s), r / 127)
            return y if layer.bias is None else y.add_(layer.bias)
        return matmul, add_matmul

    models = {}
    for name in ("fbgemm", "int_mm"):
        for layer in small:  # FastKVModel binds the layers' callables when it is built
            layer.matmul_2d, layer.add_matmul_2d = kernels[id(layer)] if name == "fbgemm" else on_int_mm(layer)
        models[name] = FastKVModel(m)
    ctx = torch.randint(0, 30000, (200,))

    def step_ms(kv, n):
        kv.reset(512)
        kv.forward(ctx, last=1)
        toks, ts = torch.randint(0, 30000, (n,)), []
        for _ in range(25):
            kv.keep(200)
            t = time.perf_counter()
            kv.forward(toks)
            ts.append(time.perf_counter() - t)
        return 1e3 * sorted(ts)[12]

    runs = {name: {n: [] for n in (1, 4, 8)} for name in models}
    for rep in range(3):  # interleaved, the order alternating
        for n in (1, 4, 8):
            for name in (list(models) if rep % 2 == 0 else list(models)[::-1]):
                runs[name][n].append(step_ms(models[name], n))
    for name, by_n in runs.items():
        med = {n: sorted(v)[1] for n, v in by_n.items()}
        print(f"{name}: T(1) {med[1]:.2f} ms, T(4)/T(1) {med[4] / med[1]:.2f}, T(8)/T(1) {med[8] / med[1]:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(p.parse_args().threads)
    layers()
    whole_step()

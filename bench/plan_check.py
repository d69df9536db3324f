"""GPU check of prepared launches for the kernels that write into their operands or return nothing (kernel.plan.call):
Flux's in-place residual tails (``out=x``), Wan's residual + LayerNorm, Ideogram 4's residual tail and the QK norm +
RoPE, each called three times through ``kernel.plan.call`` with new tensors (the later calls re-issue the first
call's launches) and compared bit for bit with the wrapper called directly on copies of the same inputs.

    python bench/plan_check.py        (exit status 1 when a result differs)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import kernel.fused as kf
    from kernel import plan
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, dtype=bf, s=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * s).to(dtype)
    m, k, tpb = 1024, 3072, 512

    def flux_tail():
        x, y, gate = r(m, k), r(m, k), torch.tanh(r(2, 1, k))
        sc, sh = r(2, 1, k, s=0.1), r(2, 1, k, s=0.1)
        return (kf.residual_add_layernorm_modulate_quantize, [x, y, gate, tpb, 1e-6, sc, sh, None, True, x], [0, 9])

    def flux_add():
        x, y, gate = r(m, k), r(m, k), torch.tanh(r(2, 1, k))
        return (kf.residual_add, [x, y, gate, tpb, True, x], [0, 5])

    def wan_add_norm():
        w, b = 1 + r(k, s=0.1), r(k, s=0.1)
        return (kf.residual_add_layernorm, [r(m, k), r(m, k), torch.tanh(r(2, 1, k)), tpb, 1e-6, w, b], [])

    def ideogram_tail():
        kk = 4608
        return (kf.gated_residual_rmsnorm, [r(m, kk), r(m, kk), 1 + r(kk, s=0.1), 1e-6, torch.tanh(r(2, kk)), tpb,
                                            1 + r(kk, s=0.1), 1e-6, 1 + r(2, kk, s=0.1), None], [])

    def qk_rope():
        h, d, l = 18, 256, 512
        q, k2 = (torch.empty(1, l, h, d, device=dev, dtype=bf).transpose(1, 2) for _ in range(2))
        pe = r(1, 1, l, d // 2, 2, 2, dtype=torch.float32)
        return (kf.qk_norm_rope, [r(1, l, 3 * h * d), h, 1 + r(d, s=0.1), 1 + r(d, s=0.1), 1e-6, 1e-6, pe, q, k2,
                                  None, 0, True], [7, 8])

    bad = 0
    cases = (("flux tail (in place) + LN·mod + quantize", flux_tail), ("flux x += y * gate", flux_add),
             ("wan residual + LayerNorm", wan_add_norm), ("ideogram4 residual tail + next norm", ideogram_tail),
             ("ideogram4 QK norm + split-half RoPE", qk_rope))
    for name, make in cases:
        ok = True
        for _ in range(3):
            fn, args, written = make()
            # the direct call on copies (an operand passed twice stays one object)
            copies = {id(a): a.clone() for a in args if isinstance(a, torch.Tensor)}
            ref_args = [copies[id(a)] if isinstance(a, torch.Tensor) else a for a in args]
            want = fn(*ref_args)
            got = plan.call(fn, *args)
            outs = lambda o: [t for t in (o if isinstance(o, tuple) else (o,)) if isinstance(t, torch.Tensor)]
            ok &= all(torch.equal(a, b) for a, b in zip(outs(got), outs(want))) and len(outs(got)) == len(outs(want))
            ok &= all(torch.equal(args[i], ref_args[i]) for i in written)
        print(f"{name:42s} {'OK: planned calls equal the direct ones' if ok else 'DIFFERS'}", flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Device-side quick check: sm_90 kernel variants vs a float32 torch reference (GPU only).

Usage: ``python tools/attention_check.py [-DATTN_X=1 ...]`` (extra defines per variant set,
separated by ``/``). Prints the relative L2 error of each variant on a few odd shapes.
"""

from __future__ import annotations

import sys
import traceback

import cupy
import torch

from deviceops.kernels import attention as attn
from deviceops.kernels.attention import AttentionOverride
from deviceops.kernels.runtime import overrides


def ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (lk - lq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vv


def main() -> None:
    # sm_90 tile configs to check besides the planned one: "BN,NWG,NSTAGE" arguments
    variants: list[tuple[int, int, int] | None] = [None] + [
        tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]]  # type: ignore[misc]
    shapes = [(1, 2, 2, 200, 300, 128, True), (1, 2, 1, 129, 129, 64, False), (1, 2, 2, 130, 90, 256, True),
              (1, 2, 2, 100, 100, 96, False), (2, 4, 2, 1000, 1000, 128, True)]  # fmt: skip
    s = cupy.cuda.Stream(non_blocking=True)
    for var in variants:
        ctx = overrides(AttentionOverride(sm90_config=var))
        ctx.__enter__()
        for b, hq, hkv, lq, lk, d, causal in shapes:
            for tdt in (torch.float16, torch.bfloat16):
                q = torch.randn(b, hq, lq, d, device="cuda", dtype=tdt)
                k = torch.randn(b, hkv, lk, d, device="cuda", dtype=tdt)
                v = torch.randn(b, hkv, lk, d, device="cuda", dtype=tdt)
                o = torch.full_like(q, float("nan"))
                torch.cuda.synchronize()
                try:
                    attn.flash_attention_cuda(*(cupy.from_dlpack(t.view(torch.int16)).view(
                        attn.supported_dtypes()[1 if tdt == torch.float16 else 2]) for t in (q, k, v, o)),
                        causal=causal, stream=s)  # fmt: skip
                    s.synchronize()
                    r = ref(q, k, v, causal)
                    err = ((o.float() - r).norm() / r.norm()).item()
                    print(
                        f"{var} {(b, hq, hkv, lq, lk, d, causal)} {tdt}: rel_err={err:.2e} nan={o.isnan().any().item()}"
                    )
                except Exception:
                    traceback.print_exc()


def decode_nosplit() -> None:
    s = cupy.cuda.Stream(non_blocking=True)
    for lk in (1, 31, 64, 256, 1000, 4096):
        for hq, hkv in ((4, 1), (32, 8)):
            q = torch.randn(2, hq, 1, 128, device="cuda", dtype=torch.float16)
            k = torch.randn(2, hkv, lk, 128, device="cuda", dtype=torch.float16)
            v = torch.randn(2, hkv, lk, 128, device="cuda", dtype=torch.float16)
            o = torch.full_like(q, float("nan"))
            torch.cuda.synchronize()
            attn.flash_attention_cuda(*(cupy.from_dlpack(t) for t in (q, k, v, o)), stream=s)
            s.synchronize()
            r = ref(q, k, v, False)
            err = ((o.float() - r).norm() / r.norm()).item()
            print(f"nosplit lk={lk} hq={hq} hkv={hkv}: err={err:.2e} nan={o.isnan().sum().item()}")


if __name__ == "__main__":
    decode_nosplit()
    main()

"""Adam/AdamW on a flat ZeRO partition: torch's fused kernel over runs of decayed and undecayed elements.

Used by :class:`~megazero.zero.optimizer.ZeroOptimizer` for its owned partition (on the device, or on the host
in chunks under offload, :mod:`.offload`); the arithmetic is ``torch.optim.Adam``/``AdamW``'s single-tensor update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megazero.config.schema import OptimizerConfig
from megazero.zero.grads import OwnedGrads, split_runs

__all__ = ["ADAM_CHUNK", "adam_update"]

# Elements per update where a separate fp32 master is updated: 16-bit gradients are converted to fp32 one
# chunk at a time, and under offload each updated chunk is copied back while the next is computed.
ADAM_CHUNK = 1 << 23


def adam_update(p: torch.Tensor, g: OwnedGrads, lr: float, lo: int, hi: int, *, cfg: OptimizerConfig, step: int,
                decay_runs: Sequence[tuple[int, int]], exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step_tensor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
    """One Adam/AdamW update of the owned elements [lo, hi) of a flat partition, held in ``p``.

    ``g`` gives their gradients (fp32 views), ``exp_avg``/``exp_avg_sq`` are the whole partition's moments,
    ``decay_runs`` the [start, end) runs of weight-decayed elements (matrices) and ``step`` Adam's step count.

    Runs torch's fused Adam(W) kernel (CPU and CUDA) over the flat buffer's runs: the weight-decayed runs
    (matrices) in one call, the others in a second; falls back to the same arithmetic in plain ops. The
    kernel reads Adam's step from a tensor on ``p``'s device: ``step_tensor`` (holding ``step``, kept by the
    caller and advanced once per step) serves every run, so a step makes no tensor per run. ``found_inf`` (a
    0-dim tensor on ``p``'s device, fused kernel only) skips the update where it is nonzero, decided on the device.
    """
    beta1, beta2 = cfg.betas
    t = step
    runs: list[tuple[int, int, bool]] = []  # (start, end, decayed) covering [lo, hi)
    pos = lo
    for ra, rb in decay_runs:
        a, b = max(ra, lo), min(rb, hi)
        if a >= b:
            continue
        if pos < a:
            runs.append((pos, a, False))
        runs.append((a, b, True))
        pos = b
    if pos < hi:
        runs.append((pos, hi, False))
    runs = [(a, b, d) for ra, rb, d in runs for a, b in split_runs([(ra, rb)], g.bounds)]
    fused = getattr(torch, "_fused_adamw_" if cfg.decoupled_weight_decay else "_fused_adam_", None)
    if fused is not None and (step_tensor is None or step_tensor.device != p.device):
        step_tensor = torch.full((), float(t), device=p.device)  # a fill: no host copy
    gs_all = g.fp32_runs([(a, b) for a, b, _ in runs])  # 16-bit gradients: one conversion per segment
    for decayed in (True, False):
        sel = [(a - lo, b - lo) for a, b, d in runs if d == decayed]
        if not sel:
            continue
        ps = [p[a:b] for a, b in sel]
        gs = [x for x, (_, _, d) in zip(gs_all, runs) if d == decayed]
        ms, vs = ([x[lo + a: lo + b] for a, b in sel] for x in (exp_avg, exp_avg_sq))
        wd = cfg.weight_decay if decayed else 0.0
        if fused is not None:
            fused(ps, gs, ms, vs, [], [step_tensor] * len(sel), lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                  eps=cfg.eps, amsgrad=False, maximize=False, found_inf=found_inf)
            continue
        if found_inf is not None:
            raise RuntimeError("adam_update: found_inf needs torch's fused Adam kernel")
        for pp, gg, m, v in zip(ps, gs, ms, vs):
            if wd and cfg.decoupled_weight_decay:
                pp.mul_(1 - lr * wd)
            elif wd:
                gg = gg.add(pp, alpha=wd)
            m.lerp_(gg, 1 - beta1)
            v.mul_(beta2).addcmul_(gg, gg, value=1 - beta2)
            denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(cfg.eps)
            pp.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))

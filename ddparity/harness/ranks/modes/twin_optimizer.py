"""The calibration twin's optimizer, where it computes in a lower precision than the
gradients (Muon's bf16 Newton-Schulz products): the rounding a sharded run adds inside
the optimizer step, which no reordering of the batch shows.

Under FSDP2 such an optimizer's products run on DTensor shards: a product whose
contraction is split is summed from W partial products, each rounded to bf16, so its
elements differ from one device's by an ulp of bf16 or so, and the Newton-Schulz iteration
carries that through five products. The twin therefore moves its optimizer's input (the
gradients, after they are recorded) by an ulp of that precision and the output of every
low-precision product and norm the step computes by :data:`PRODUCT_ULPS` ulps, up or down
at random: its distance to the reference then holds what a correct sharded run shows
(``benchmarks/muon_seeds.py``).

Rounding that wide is a few % of a Muon update, so the parameters' tolerance at step 0 can
reach the update itself: a learning rate x W would pass it. What still tells a wrong update
is its size: every parameter of a rank moves by one factor of the reference's move, far from
1 where a correct run's rounding leaves it within a few thousandths
(:data:`ddparity.checks.tolerance.UPDATE_SHARE`).
"""

from __future__ import annotations

from typing import Any

from ddparity.harness.ranks.comparer import Comparer
from ddparity.harness.ranks.stepping import results_through

PRODUCT_ULPS = 2.0
"""How many ulps of the optimizer's precision each of its low-precision products and norms
is moved by in the twin. Over seeds 0-7 of ``fixtures.calibration.muon_clean`` under fsdp
and hsdp at 2 and 4 ranks (``benchmarks/muon_seeds.py``): with none (an ulp of the input
only), 6 of 32 correct runs came 1.6-2.5x over their tolerance at steps 1-2 (the parameters'
rounding carried into the next gradients); with one ulp the worst came 1.1x; with two, 0.22x
of it."""

JITTER_SEED = 20240608
"""The generator of this rounding: its own, never the global streams (the reference's)."""

REDUCING_OPS = ("mm", "matmul", "__matmul__", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot",
                "einsum", "tensordot", "norm", "vector_norm", "matrix_norm", "sum", "mean")
"""The ops whose every output element is a sum of many products (by their name, as a
function of ``torch``, ``torch.linalg`` or a method): where a sharded run sums partials."""


class RoundedForTheOptimizer:
    """The twin's sink where its optimizer computes in ``dtype``, lower than the gradients':
    the comparer's, with the gradients moved by an ulp of ``dtype`` once recorded, and, told
    as an optimizer watcher (:class:`~ddparity.harness.ranks.stepping.OptimizerWatch`), the
    optimizer step's own low-precision sums moved by :data:`PRODUCT_ULPS` of them."""

    watches_the_optimizer = True

    def __init__(self, sink: Comparer, dtype: str) -> None:
        import torch

        self._sink, self._eps = sink, torch.finfo(getattr(torch, dtype)).eps
        self._generator = torch.Generator().manual_seed(JITTER_SEED)
        self._mode: Any = None

    def grads(self, step: int, model: Any) -> None:
        import torch

        self._sink.grads(step, model)
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad
                if g is None or g.layout != torch.strided or not g.is_floating_point() or not g.numel():
                    continue
                g.add_(g * self._eps * self._signs(g))

    def _signs(self, t: Any) -> Any:
        import torch

        return torch.randint(0, 2, t.shape, generator=self._generator).to(t.device, t.dtype) * 2 - 1

    # as an optimizer watcher: around the optimizer's own work (after the gradients are recorded)
    def begin(self, step: int) -> None:
        pass

    def end(self) -> None:
        pass

    def pre(self) -> None:
        if self._mode is None:
            self._mode = results_through(self._rounded)
            self._mode.__enter__()

    def post(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    close = post

    def _rounded(self, func: Any, out: Any) -> Any:
        """``out``, the result of ``func``, moved by :data:`PRODUCT_ULPS` ulps of itself where
        ``func`` is one of :data:`REDUCING_OPS` and ``out`` a low-precision floating tensor."""
        import torch

        if (getattr(func, "__name__", None) in REDUCING_OPS and isinstance(out, torch.Tensor)
                and out.dtype in (torch.bfloat16, torch.float16) and out.numel()
                and not out.requires_grad):  # (an optimizer that differentiates: its graph stays whole)
            with torch.no_grad():
                return out + out * (PRODUCT_ULPS * torch.finfo(out.dtype).eps) * self._signs(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)  # after(), note_scales(): the comparer's own


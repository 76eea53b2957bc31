"""The parameters a training step changes in place outside any optimizer's step: a watcher
of the reference's :class:`~ddparity.harness.ranks.stepping.OptimizerWatch`, whose findings
name a change each rank makes from its own shard (:mod:`ddparity.checks.causes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ChangedOutside:
    """The parameters a step changed in place outside ``optimizer.step()`` (before it: in the
    forward, as ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up; or after
    it, in the step's own code), per step: by name, with what holds them (``"Embedding
    (max_norm=1.0)"``). Told by each parameter's version counter, which every in-place op
    bumps, or by its sum (a change through ``.data``, which a version counter does not see:
    ``p.data.clamp_()``, a VQ codebook's ``.data.mul_()``; one that keeps every sum, such as
    a permutation of a parameter's values through ``.data``, is not seen). Where such a change
    depends on the batch, each rank makes it from its own shard only. Any optimizer's step
    over the model's parameters is the optimizer's, not outside it: a GAN's discriminator's,
    stepped between two forwards. Its steps are told by torch's global optimizer hooks alone
    (the outermost call: a wrapper's base optimizer is part of the wrapper's step), not also
    by the watch's :meth:`pre` and :meth:`post`, which would measure every parameter twice."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._params = list(model.named_parameters())
        self.changed: dict[int, dict[str, str]] = {}
        self._step = 0
        self._versions: list[tuple[int, float]] | None = None
        self._handles: list[Any] = []

    def begin(self, step: int) -> None:
        self._step, self._versions = step, self._now()
        if not self._handles:
            import torch
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            from ddparity.harness.optimizer_steps import nested_step

            mine = {id(p) for _, p in self._params}

            def around(then: Callable[[], None]) -> Callable[..., None]:
                def hook(optimizer: Any, args: tuple, kwargs: dict) -> None:
                    if not nested_step() and any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
                        then()
                return torch.compiler.disable(hook)

            self._handles = [register_optimizer_step_pre_hook(around(self._stepping)),
                             register_optimizer_step_post_hook(around(self._stepped))]

    def pre(self) -> None:
        pass  # told by the global hook (see the class)

    def post(self) -> None:
        pass

    def _stepping(self) -> None:
        self._note()
        self._versions = None  # the optimizer's own changes are not counted

    def _stepped(self) -> None:
        self._versions = self._now()

    def end(self) -> None:
        self._note()
        self._versions = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _now(self) -> list[tuple[int, float]]:
        import torch

        by_device: dict[Any, list[Any]] = {}
        with torch.no_grad():
            for _, p in self._params:
                t = torch.view_as_real(p) if p.is_complex() else p
                total = t.detach().sum(dtype=torch.float64) if p.layout == torch.strided else p.new_zeros((), dtype=torch.float64)
                by_device.setdefault(p.device, []).append(total)
        sums = {device: iter(torch.stack(s).tolist()) for device, s in by_device.items()}  # a sync per device
        return [(p._version, next(sums[p.device])) for _, p in self._params]

    def _note(self) -> None:
        if self._versions is None:
            return
        for (name, _), before, now in zip(self._params, self._versions, self._now()):
            if now[0] != before[0] or not (now[1] == before[1] or now[1] != now[1] and before[1] != before[1]):
                self.changed.setdefault(self._step, {})[name] = self._holder(name)

    def _holder(self, name: str) -> str:
        module = self._model.get_submodule(name.rpartition(".")[0])
        max_norm = getattr(module, "max_norm", None)
        return f"{type(module).__name__}(max_norm={max_norm:g})" if max_norm is not None else type(module).__name__

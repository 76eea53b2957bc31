"""``Case``: what to train, described once, run identically in every mode.

Also resolves user targets (``pkg.mod:fn`` or ``path/file.py:fn``) and the named losses
and optimizers. A leaf module: it imports no harness code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ddparity.errors import CaseError, UsageError

OPTIMIZERS = ("sgd", "adam", "adamw")
DDP_OPTIONS = (
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "broadcast_buffers",
    "bucket_cap_mb",
    "bucket_cap_mb_list",
)


def takes_bucket_lists() -> bool:
    """Whether this torch's DistributedDataParallel takes ``bucket_cap_mb_list`` (caps bucket by bucket)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


@dataclass(kw_only=True)
class Case:
    """One training set-up to compare across modes and world sizes.

    ``model`` builds the module (a callable, or ``"pkg.mod:fn"`` / ``"file.py:fn"``);
    ``data(step, generator)`` returns the GLOBAL batch ``(inputs, targets)`` of a step;
    ``loss`` names a ``torch.nn.functional`` loss or is ``(outputs, targets) -> scalar``;
    ``optimizer`` is ``"sgd" | "adam" | "adamw"`` or ``(params) -> Optimizer``.
    ``train_step(model, batch, optimizer, ctx)`` (optional) is your own step, run in every
    mode instead of ddparity's (then ``data`` may return any nest of tensors, and ``loss``
    is not used); see :class:`ddparity.harness.ranks.stepping.StepContext` for ``ctx``.
    Tensors whose dim 0 is the global batch size are split between replicas, the others
    reach every replica whole; wrap one in :func:`whole` to say it is not batched.
    ``ddp_options`` are passed to ``DistributedDataParallel``; ``comm_hook`` (optional)
    is registered with ``DistributedDataParallel.register_comm_hook(comm_hook_state, comm_hook)``;
    every run gets its own copy of ``comm_hook_state``.
    ``fsdp(model, mesh)`` (optional) applies ``fully_shard`` as your code does (its
    wrapping, ``MixedPrecisionPolicy``, ``ignored_params``...) in modes ``fsdp`` and
    ``hsdp`` and returns the model (or None: the same model); by default each direct child
    holding parameters is sharded, then the root. ``hsdp_shard`` is the shard size S of
    mode ``hsdp``'s (replicate, shard) mesh (default 2; ``--hsdp-shard`` overrides it).
    """

    model: Callable[[], Any] | str
    data: Callable[[int, Any], Any] | str
    loss: str | Callable[[Any, Any], Any] = "cross_entropy"
    optimizer: str | Callable[[Any], Any] = "sgd"
    lr: float = 0.01
    steps: int = 3
    seed: int = 0
    dtype: Any = None  # torch.dtype; None means torch.float32
    ddp_options: dict[str, Any] = field(default_factory=dict)
    comm_hook: Callable[..., Any] | None = None
    comm_hook_state: Any = None
    train_step: Callable[[Any, Any, Any, Any], Any] | str | None = None
    fsdp: Callable[[Any, Any], Any] | None = None
    hsdp_shard: int | None = None
    name: str | None = None
    target: str | None = None  # "module:function" it was loaded from, for repro commands

    def validate(self) -> Case:
        """Raise :class:`UsageError` naming the first bad field and its fix."""
        import torch

        _keep_file_names()  # a script's own functions, pickled by value to the ranks

        if not (callable(self.model) or isinstance(self.model, str)):
            raise UsageError(f"Case.model must be a callable returning an nn.Module, got {self.model!r}")
        if not (callable(self.data) or isinstance(self.data, str)):
            raise UsageError(
                f"Case.data must be a callable (step, generator) -> (inputs, targets), got {self.data!r}"
            )
        resolve_loss(self.loss)
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZERS:
            raise UsageError(
                f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)} "
                "or a callable (params) -> torch.optim.Optimizer"
            )
        if not (isinstance(self.optimizer, str) or callable(self.optimizer)):
            raise UsageError(f"Case.optimizer must be a name or a callable, got {self.optimizer!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise UsageError(f"Case.steps must be an int >= 1, got {self.steps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UsageError(f"Case.seed must be an int with 0 <= seed < 2**63 (torch's generators), got {self.seed!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise UsageError(f"Case.lr must be a positive, finite number, got {self.lr!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise UsageError(f"Case.dtype must be a floating torch.dtype such as torch.float32, got {self.dtype!r}")
        unknown = sorted(set(self.ddp_options) - set(DDP_OPTIONS))
        if unknown:
            raise UsageError(
                f"unknown DDP option(s) {unknown}; ddparity passes these through: {', '.join(DDP_OPTIONS)}"
            )
        if "bucket_cap_mb_list" in self.ddp_options and not takes_bucket_lists():
            raise UsageError(f"Case.ddp_options: DistributedDataParallel in torch {torch.__version__} takes no "
                             f"bucket_cap_mb_list (newer torch releases do): upgrade torch, or give bucket_cap_mb")
        if self.train_step is not None and not (callable(self.train_step) or isinstance(self.train_step, str)):
            raise UsageError(
                f"Case.train_step must be a callable (model, batch, optimizer, ctx) -> loss, or 'module:function', "
                f"got {self.train_step!r}"
            )
        if self.fsdp is not None and not callable(self.fsdp):
            raise UsageError(f"Case.fsdp must be a callable (model, mesh) -> model that applies fully_shard, "
                             f"got {self.fsdp!r}")
        if self.hsdp_shard is not None and (isinstance(self.hsdp_shard, bool) or not isinstance(self.hsdp_shard, int)
                                            or self.hsdp_shard < 1):
            raise UsageError(f"Case.hsdp_shard must be an int >= 1 (the shard size of HSDP's mesh), "
                             f"got {self.hsdp_shard!r}")
        if self.comm_hook is not None and not callable(self.comm_hook):
            raise UsageError(f"Case.comm_hook must be callable (state, bucket) -> Future, got {self.comm_hook!r}")
        return self

    @property
    def torch_dtype(self) -> Any:
        import torch

        return self.dtype if self.dtype is not None else torch.float32

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        model = self.model if isinstance(self.model, str) else getattr(self.model, "__qualname__", "model")
        return str(model)

    def with_steps(self, steps: int | None) -> Case:
        return self if steps is None else dataclasses.replace(self, steps=steps)


@dataclass(frozen=True, slots=True)
class Whole:
    """A tensor of the global batch that is not batched: every replica gets all of it."""

    tensor: Any


def whole(tensor: Any) -> Whole:
    """Mark ``tensor`` (in what ``Case.data`` returns) as not batched: every replica gets it
    whole, even when its dim 0 happens to equal the batch size (a shared matrix, position
    ids). The model receives the tensor itself."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"ddparity.whole() takes a tensor, got {type(tensor).__name__}")
    return Whole(tensor)


@dataclass(frozen=True, slots=True)
class Batched:
    """A tensor of the global batch whose batch dimension is ``dim``, not 0 (time-major data):
    held batch-major (``tensor``: the batch moved to dim 0) while ddparity shards it; the
    model gets each share with the batch back at ``dim``."""

    tensor: Any
    dim: int


def batched(tensor: Any, dim: int) -> Batched:
    """Mark ``tensor`` (in what ``Case.data`` returns) as batched along ``dim`` instead of dim 0:
    ``ddparity.batched(x, dim=1)`` for an RNN's time-major ``(T, B, F)`` input
    (``batch_first=False``). Every replica gets its share of that dimension; the model
    receives a tensor of the same layout, as ``DistributedDataParallel`` users feed it."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"ddparity.batched() takes a tensor, got {type(tensor).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise UsageError(f"ddparity.batched(tensor, dim={dim!r}): dim must be an int naming one of the tensor's "
                         f"{tensor.dim()} dimension(s) (shape {list(tensor.shape)}), e.g. dim=1 for (T, B, F) data")
    dim %= tensor.dim()
    return Batched(tensor.movedim(dim, 0), dim)


@dataclass(frozen=True, slots=True)
class Samples:
    """A list of the global batch's samples, one item each (an image, a target dict, a
    sequence of its own length): each replica gets its slice of the list."""

    items: list


def samples(items: Any) -> Samples:
    """Mark a list (in what ``Case.data`` returns) as one item per sample, the layout of
    detection targets and variable-length sequences: ``(ddparity.samples(images),
    ddparity.samples(targets))``. Each replica gets its contiguous slice of the list, as a
    ``DistributedSampler`` would hand it its samples; the model and step receive a plain
    list. Tensors inside are not cut (their dim 0 is the item's own)."""
    if not isinstance(items, (list, tuple)) or not items:
        raise UsageError(f"ddparity.samples() takes a non-empty list of samples, got "
                         f"{type(items).__name__}{' (empty)' if isinstance(items, (list, tuple)) else ''}")
    return Samples(list(items))


def resolve_loss(loss: str | Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    if callable(loss):
        return loss
    import torch.nn.functional as F

    fn = getattr(F, loss, None) if isinstance(loss, str) else None
    if fn is None or not callable(fn) or not ("loss" in loss or "entropy" in loss or loss == "kl_div"):
        raise UsageError(
            f"unknown loss {loss!r}; use the name of a torch.nn.functional loss "
            "(cross_entropy, mse_loss, nll_loss, l1_loss, ...) or a callable (outputs, targets) -> scalar"
        )
    return fn


def make_optimizer(case: Case, params: Any) -> Any:
    import torch

    if callable(case.optimizer):
        made = case.optimizer(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise CaseError(f"the optimizer factory returned {type(made).__name__}, not a torch.optim.Optimizer; return "
                            "the optimizer it builds over the parameters it is given (lambda params: torch.optim.SGD(params, lr=0.1))")
        return made
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[case.optimizer]
    return cls(params, lr=case.lr)


def load_target(target: str) -> Any:
    """Import ``pkg.mod:attr`` or ``path/to/file.py:attr`` and return the attribute.

    A file is imported under a private module name and registered with cloudpickle to
    travel *by value*, since rank processes cannot import it by that name.
    """
    if not isinstance(target, str) or ":" not in target:
        raise UsageError(
            f"target {target!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise UsageError(f"target {target!r} must name both a module or file and a function after ':'")
    if where.endswith(".py") or os.sep in where:
        module = _import_file(where, target)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to you import
        try:
            with _no_exit(f"importing {where!r}"):
                module = importlib.import_module(where)
        except ImportError as exc:
            raise UsageError(
                f"cannot import module {where!r} for target {target!r}: {exc}; check the name, "
                "run from the directory that contains it, or give a file path instead"
            ) from None
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"importing {where!r} raised {type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{where!r} has no attribute {attr!r} (target {target!r})") from None


def _import_file(path: str, target: str) -> Any:
    import cloudpickle

    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise UsageError(f"file {path!r} does not exist (target {target!r})")
    digest = hashlib.sha1(full.encode()).hexdigest()[:10]
    name = f"_ddparity_target_{os.path.splitext(os.path.basename(full))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path!r} as Python (target {target!r})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(full)
    if directory not in sys.path:
        sys.path.insert(0, directory)  # its own sibling imports work, as under `python file.py`
    try:
        with _no_exit(f"importing {path!r}"):
            spec.loader.exec_module(module)
    except UsageError:
        del sys.modules[name]
        raise
    except Exception as exc:
        del sys.modules[name]
        raise UsageError(f"importing {path!r} raised {type(exc).__name__}: {exc}") from None
    cloudpickle.register_pickle_by_value(module)
    _BY_VALUE_FILES.add(full)
    _keep_file_names()
    return module


_BY_VALUE_FILES: set[str] = set()


def _keep_file_names() -> None:
    """cloudpickle (3.x) names the code of the functions it pickles by value
    ``<dynamic-code>``: a rank's traceback and a collective's call site in a target file, or
    in the script that called ``ddparity.check`` (``__main__``), would not say which file. Its
    code reducer, wrapped once, keeps the names of those files (anyone else's code is pickled
    as cloudpickle makes it)."""
    import types

    import cloudpickle

    table = getattr(getattr(cloudpickle, "Pickler", None), "_dispatch_table", None)
    if not isinstance(table, dict):
        return
    original = table.get(types.CodeType)
    if original is None or getattr(original, "keeps_file_names", False):
        return  # an older cloudpickle keeps them itself

    def reduce(code: types.CodeType) -> Any:
        reduced = original(code)
        if (code.co_filename in _BY_VALUE_FILES or code.co_filename == _main_file()) and isinstance(
                reduced, tuple) and len(reduced) == 2:
            rebuild, args = reduced
            return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
        return reduced

    reduce.keeps_file_names = True  # type: ignore[attr-defined]
    table[types.CodeType] = reduce


def _main_file() -> str | None:
    """The file of the script Python runs (``__main__``), None where there is none (a REPL)."""
    return getattr(sys.modules.get("__main__"), "__file__", None)


class _HardExit(BaseException):
    """``os._exit`` called by code that builds a Case (a BaseException, as SystemExit is:
    the user's ``except Exception`` lets it through)."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.code = code


@contextmanager
def _no_exit(doing: str) -> Iterator[None]:
    """``sys.exit`` and ``os._exit`` inside (a script imported as a target) become a
    UsageError that says so: ``os._exit`` would end ddparity on the spot, without a word."""
    real = os._exit

    def refused(code: int) -> NoReturn:
        raise _HardExit(code)

    os._exit = refused  # type: ignore[assignment]
    try:
        yield
    except (SystemExit, _HardExit) as exc:
        call = "sys.exit" if isinstance(exc, SystemExit) else "os._exit"
        raise UsageError(f"{doing} called {call}({exc.code!r}): code that builds a Case must not exit (put a "
                         f"script's own work under `if __name__ == \"__main__\":`)") from None
    finally:
        os._exit = real


def load_case(target: str) -> Case:
    """Call the function named by ``target`` and check that it returns a :class:`Case`."""
    fn = load_target(target)
    if isinstance(fn, Case):
        case = fn
    elif callable(fn):
        try:
            with _no_exit(f"calling {target}"):
                case = fn()
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"{target} raised {type(exc).__name__}: {exc}") from None
    else:
        raise UsageError(f"{target} is neither a function returning a Case nor a Case")
    if not isinstance(case, Case):
        raise UsageError(
            f"{target} returned {type(case).__name__}, not a ddparity.Case; "
            "return Case(model=..., data=..., loss=..., optimizer=...)"
        )
    case = dataclasses.replace(case, name=case.name or target, target=target)
    return case.validate()

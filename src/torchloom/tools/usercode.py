"""A user's own model named on the command line as ``path/to/file.py:factory``.

``torchloom train --model``, ``torchloom verify MODEL``, ``torchloom plan MODEL`` and
``torchloom show MODEL`` take, beside zoo names and transformers folders, a Python file and
the name of a function in it: the *factory*, called with no arguments, returns either

* an ``nn.Module`` whose ``forward(ids)`` maps token ids ``(batch, seq)`` (``torch.long``)
  to logits ``(batch, seq, vocab)`` (a tensor, or an object with a ``.logits`` tensor);
  torchloom wraps it in a :class:`TokenLM`, which adds the causal-LM loss transformers
  computes from ``labels`` (next-token cross-entropy) and ``get_input_embeddings()`` (the
  model's first ``nn.Embedding``: its rows are the vocabulary the data is checked against);
* or a transformers model (a ``PreTrainedModel`` taking ``input_ids`` and ``labels`` and
  returning ``.loss`` and ``.logits``), used as it is.

This runs the file's code, as ``python file.py`` would: it is code the user runs on
purpose, so it is taken only where the user types it, on the command line. A TOML config
(:func:`torchloom.apps.jobconfig.load_toml`) and a recipe (:mod:`torchloom.core.refs`: a
reference names a public module of torch, torchloom or transformers) cannot name it.

What is checked, each failure a ``ScheduleError`` of the caller's class naming the input,
the value and the fix: the text is ``FILE.py:NAME`` with ``NAME`` an identifier, the file
exists and imports, ``NAME`` is a callable of it, the call succeeds (its exception
summarised in one line), it returns an ``nn.Module``, and one forward of a ``(2, seq)``
batch of token ids on values without data (parameters on ``meta``, fake tensors: nothing
allocated) returns logits of shape ``(2, seq, V)`` with ``V`` at least the vocabulary.

The file is imported once per process under a unique module name (``torchloom_user_`` and
a hash of its absolute path; a changed file is imported again), with its folder first on
``sys.path`` while it is imported and while the factory runs, so that it can import the
modules beside it.

>>> import os, tempfile, textwrap
>>> path = os.path.join(tempfile.mkdtemp(), "lm.py")
>>> _ = open(path, "w").write(textwrap.dedent('''
...     from torch import nn
...     def make():
...         return nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))
... '''))
>>> spec = CodeSpec.parse(f"{path}:make")
>>> spec.name, is_code_spec(f"{path}:make"), is_code_spec("gpt2")
('make', True, False)
>>> model = load(f"{path}:make", meta=True)
>>> type(model).__name__, model.vocab_size, next(model.parameters()).device.type
('TokenLM', 64, 'meta')
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import keyword
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import ScheduleError, TrainOptionError

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from typing_extensions import TypeIs

__all__ = ["CodeSpec", "TokenLM", "check_contract", "inner_module", "is_code_spec", "load",
           "looks_like_code", "schedule_root"]

_STAMPS: dict[str, int] = {}  # module name -> the file's mtime when it was imported

EXAMPLE = "path/to/model.py:make_model"
"""How a factory is named, for fixes."""


# --------------------------------------------------------------------------- the text


def _split(text: str) -> tuple[str, str] | None:
    if not isinstance(text, str) or ":" not in text:
        return None
    path, _, name = text.rpartition(":")
    if not path.endswith(".py"):
        return None
    return path, name


def looks_like_code(text: Any) -> bool:
    """Whether ``text`` names Python code: ``FILE.py:NAME`` (whatever ``NAME`` is, whether
    or not the file exists) or a ``.py`` file.

    >>> looks_like_code("model.py:make"), looks_like_code("model.py"), looks_like_code("gpt2")
    (True, True, False)
    """
    return isinstance(text, str) and (_split(text) is not None or text.endswith(".py"))


def is_code_spec(text: Any) -> bool:
    """Whether ``text`` is ``FILE.py:NAME`` with ``NAME`` an identifier and the file existing
    (nothing is imported)."""
    parts = _split(text)
    return parts is not None and _identifier(parts[1]) and os.path.isfile(parts[0])


def _identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


@dataclass(frozen=True)
class CodeSpec:
    """``FILE.py:NAME``: the file and the factory's name."""

    path: str
    name: str

    @property
    def text(self) -> str:
        return f"{self.path}:{self.name}"

    @classmethod
    def parse(cls, text: str, *, error: type[ScheduleError] = TrainOptionError,
              primitive: str = "torchloom train", flag: str = "--model") -> CodeSpec:
        """The spec of ``text``, or ``error`` naming what is wrong with it (not ``.py``, no
        factory name, a name that is not an identifier, no such file)."""
        parts = _split(text)
        shown = f"{flag} {text!r}"
        if parts is None:
            raise error(f"{shown}: a model in a Python file is named FILE.py:FACTORY",
                        primitive=primitive, values={"model": text},
                        fix=f"{flag} {EXAMPLE}" if flag.startswith("-") else EXAMPLE)
        path, name = parts
        if not _identifier(name):
            raise error(f"{shown}: {name!r} is not the name of a Python function (the part "
                        "after the last ':' names the factory in the file)",
                        primitive=primitive, values={"model": text, "factory": name},
                        fix=_fix(flag, f"{path}:make_model"))
        if not os.path.isfile(path):
            where = "a folder" if os.path.isdir(path) else "no such file"
            raise error(f"{shown}: {path!r}: {where}", primitive=primitive,
                        values={"model": text, "file": path, "cwd": os.getcwd()},
                        fix=_fix(flag, f"the path of an existing file, e.g. {EXAMPLE}"))
        return cls(path, name)


def _fix(flag: str, what: str) -> str:
    return f"{flag} {what}" if flag.startswith("-") else what


# --------------------------------------------------------------------------- import and call


@contextlib.contextmanager
def _folder_on_path(folder: str) -> Iterator[None]:
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _where(exc: BaseException, path: str) -> str:
    """`` (line N of FILE)``: the last frame of the traceback inside the user's file."""
    tb, line = exc.__traceback__, None
    real = os.path.realpath(path)
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == real:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line} of {os.path.basename(path)})" if line else ""


def _module(spec: CodeSpec, error: type[ScheduleError], primitive: str, flag: str) -> Any:
    path = os.path.abspath(spec.path)
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = "".join(c if c.isalnum() else "_" for c in os.path.basename(path)[:-3])
    name = f"torchloom_user_{digest}_{stem}"
    stamp = os.stat(path).st_mtime_ns
    loaded = sys.modules.get(name)
    if loaded is not None and _STAMPS.get(name) == stamp:
        return loaded
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:  # pragma: no cover - a .py file
        raise error(f"{flag} {spec.text!r}: Python cannot load {spec.path!r}",
                    primitive=primitive, values={"model": spec.text}, fix=_fix(flag, EXAMPLE))
    module = importlib.util.module_from_spec(module_spec)
    _STAMPS[name] = stamp
    sys.modules[name] = module  # before running it: dataclasses and pickling look it up
    try:
        with _folder_on_path(os.path.dirname(path)):
            module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's code: summarised, not a traceback
        sys.modules.pop(name, None)
        raise error(f"{flag} {spec.text!r}: importing {spec.path} raised "
                    f"{_summary(exc)}{_where(exc, path)}", primitive=primitive,
                    values={"model": spec.text},
                    fix=f"fix the file (python {spec.path} shows the traceback)") from None
    return module


def call_factory(text: str, *, meta: bool = False, error: type[ScheduleError] = TrainOptionError,
                 primitive: str = "torchloom train", flag: str = "--model") -> nn.Module:
    """Import ``FILE.py``, call ``NAME()`` and return the module it made, unwrapped;
    ``meta``: under :func:`~torchloom.init_empty_weights` (parameters on ``meta``, nothing
    allocated)."""
    from ..runtime.materialise import init_empty_weights

    spec = CodeSpec.parse(text, error=error, primitive=primitive, flag=flag)
    module = _module(spec, error, primitive, flag)
    factory = getattr(module, spec.name, None)
    if factory is None:
        found = sorted((n for n, v in vars(module).items()
                        if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__),
                       key=lambda n: (isinstance(vars(module)[n], type), n))  # functions first
        raise error(f"{flag} {spec.text!r}: {spec.path} defines no {spec.name!r}",
                    primitive=primitive, values={"model": spec.text, "defined": found[:12]},
                    fix=_fix(flag, f"{spec.path}:{found[0]}" if found else
                             f"define def {spec.name}(): return MyModel() in {spec.path}"))
    if not callable(factory):
        raise error(f"{flag} {spec.text!r}: {spec.name} is a {type(factory).__name__}, not a "
                    "function", primitive=primitive, values={"model": spec.text},
                    fix=f"def {spec.name}(): return MyModel() in {spec.path}")
    try:
        with _folder_on_path(os.path.dirname(os.path.abspath(spec.path))), \
                (init_empty_weights() if meta else contextlib.nullcontext()):
            made = factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: summarised
        raise error(f"{flag} {spec.text!r}: calling {spec.name}() raised "
                    f"{_summary(exc)}{_where(exc, spec.path)}", primitive=primitive,
                    values={"model": spec.text},
                    fix=f"the factory takes no arguments and returns the model: fix "
                    f"{spec.name} in {spec.path}") from None
    if not isinstance(made, nn.Module):
        raise error(f"{flag} {spec.text!r}: {spec.name}() returned a {type(made).__name__}, "
                    "not an nn.Module", primitive=primitive,
                    values={"model": spec.text, "returned": type(made).__name__},
                    fix=f"return the model from {spec.name}: an nn.Module mapping token ids "
                    "(batch, seq) to logits (batch, seq, vocab), or a transformers model")
    return made


# --------------------------------------------------------------------------- the adapter


def _first_embedding(model: nn.Module) -> nn.Embedding | None:
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _logits(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    return getattr(out, "logits", out)


class TokenLM(nn.Module):
    """A module mapping token ids to logits, as a causal language model: ``forward(
    input_ids, labels=None)`` returns transformers' ``CausalLMOutput`` with ``logits`` and,
    given ``labels``, ``loss``: the next-token cross-entropy (``logits[:, :-1]`` against
    ``labels[:, 1:]``, labels of -100 ignored), as transformers' causal LMs compute it.
    The wrapped module is ``self.model`` (schedule paths start with ``model.``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def vocab_size(self) -> int:
        emb = _first_embedding(self.model)
        assert emb is not None, "checked by check_contract"
        return int(emb.num_embeddings)

    def get_input_embeddings(self) -> nn.Module:
        emb = _first_embedding(self.model)
        assert emb is not None, "checked by check_contract"
        return emb

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                **_: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        logits = _logits(self.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


def _is_transformers(model: nn.Module) -> TypeIs[PreTrainedModel]:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - a dependency
        return False
    return isinstance(model, PreTrainedModel)


def inner_module(model: nn.Module) -> nn.Module:
    """The user's module inside a :class:`TokenLM` (else ``model``)."""
    return model.model if isinstance(model, TokenLM) else model


def schedule_root(sch: Any) -> Any:
    """Where a model's schedule applies: ``sch["model"]`` for a :class:`TokenLM` (the
    user's module, so that a schedule registered for its class applies), else ``sch``."""
    return sch["model"] if isinstance(sch.mod, TokenLM) else sch


def check_contract(model: nn.Module, text: str, seq_len: int = 16, *,
                   error: type[ScheduleError] = TrainOptionError,
                   primitive: str = "torchloom train", flag: str = "--model") -> None:
    """One training forward of ``model`` (a :class:`TokenLM` or a transformers model) on a
    ``(2, seq_len)`` batch of token ids, on values without data (nothing allocated): the
    logits have shape ``(2, seq_len, V)`` with ``V`` at least the vocabulary, and a
    transformers model returns a ``loss``. ``error`` names ``text`` and the fix."""
    from ..core.outputs import no_cache_kwargs
    from ..graph.fake import _tensors_on_meta, fake_values

    inner = inner_module(model)
    emb = model.get_input_embeddings() if _is_transformers(model) else _first_embedding(inner)
    contract = ("the factory returns an nn.Module mapping token ids (batch, seq) to logits "
                "(batch, seq, vocab), or a transformers model")
    if not isinstance(emb, nn.Embedding):
        raise error(f"{flag} {text!r}: {type(inner).__name__} has no nn.Embedding: torchloom "
                    "feeds it token ids and takes the first nn.Embedding's rows as the "
                    "vocabulary", primitive=primitive,
                    values={"model": text, "class": type(inner).__name__},
                    fix=f"{contract}; embed the ids with nn.Embedding(vocab, width)")
    vocab = int(emb.num_embeddings)
    batch = 2
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    was_training = model.training
    model.train()
    try:
        with _tensors_on_meta(model, True), mode:
            fake = fake_values(mode, ids)
            if isinstance(model, TokenLM):  # the user's forward alone: its output checked
                out = inner(fake)
            else:
                out = model(input_ids=fake, labels=fake, **no_cache_kwargs(model))
    except Exception as exc:  # noqa: BLE001 - the user's forward, summarised
        where = _where(exc, text.rpartition(":")[0])
        raise error(f"{flag} {text!r}: the forward of {type(inner).__name__} on token ids "
                    f"of shape ({batch}, {seq_len}) raised {_summary(exc)}{where}",
                    primitive=primitive, values={"model": text, "seq_len": seq_len},
                    fix=f"{contract}; check that it takes sequences of {seq_len} tokens "
                    "(--seq-len)") from None
    finally:
        model.train(was_training)
    logits = _logits(out)
    if isinstance(out, (tuple, list)) or not isinstance(logits, torch.Tensor):
        raise error(f"{flag} {text!r}: the forward of {type(inner).__name__} returned a "
                    f"{type(out).__name__}, not a tensor of logits", primitive=primitive,
                    values={"model": text, "returned": type(out).__name__},
                    fix=f"{contract}: wrap it, e.g. a module whose forward returns "
                    "model(ids)[0]")
    shape = tuple(logits.shape)
    if len(shape) != 3 or shape[:2] != (batch, seq_len) or shape[2] < vocab:
        raise error(f"{flag} {text!r}: the forward of {type(inner).__name__} returned logits "
                    f"of shape {shape} for token ids of shape ({batch}, {seq_len}); they must "
                    f"be ({batch}, {seq_len}, V) with V at least the {vocab} rows of its "
                    "embedding", primitive=primitive,
                    values={"model": text, "logits": shape, "vocab": vocab},
                    fix=f"{contract}: logits for every position (nanoGPT's GPT returns only "
                    "the last position's without targets: return self.lm_head(x))")
    if isinstance(model, TokenLM):  # the loss on top
        with _tensors_on_meta(model, True), mode:
            model(input_ids=fake, labels=fake)
    elif getattr(out, "loss", None) is None:
        raise error(f"{flag} {text!r}: {type(model).__name__} returned no loss given labels: "
                    "torchloom trains causal language models", primitive=primitive,
                    values={"model": text, "class": type(model).__name__},
                    fix="return a causal LM (AutoModelForCausalLM's classes), or an "
                    "nn.Module mapping token ids to logits (torchloom adds the loss)")


def load(text: str, *, meta: bool = False, seq_len: int = 16, check: bool = True,
         error: type[ScheduleError] = TrainOptionError, primitive: str = "torchloom train",
         flag: str = "--model") -> nn.Module:
    """The model of ``FILE.py:NAME``, ready to schedule and train: a transformers model as
    the factory returned it, any other module wrapped in a :class:`TokenLM`; ``meta``: made
    under :func:`~torchloom.init_empty_weights`; ``check``: :func:`check_contract` with
    ``seq_len``-token sequences. Every failure is ``error`` (see the module docstring)."""
    made = call_factory(text, meta=meta, error=error, primitive=primitive, flag=flag)
    if _is_transformers(made):
        if getattr(made, "loss_type", None) is None:
            made.loss_type = "ForCausalLM"
        model = made.train()
    else:
        model = TokenLM(made).train()
    if check:
        check_contract(model, text, seq_len, error=error, primitive=primitive, flag=flag)
    return model

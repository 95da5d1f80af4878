"""The public surface reads like torch.cuda.graphs: every parameter typed and documented in an
``Arguments:`` block, and no signature longer than about ten parameters."""

import inspect

import pytest

import breakgraph as bg
from breakgraph import diagnostics

MAX_PARAMETERS = 10


def public_callables():
    from breakgraph import hf

    named = [(name, getattr(bg, name)) for name in bg.__all__] + [(f"hf.{name}", getattr(hf, name)) for name in hf.__all__]
    for name, obj in named:
        if inspect.isclass(obj):
            if issubclass(obj, BaseException) or issubclass(obj, Warning):
                continue
            yield f"{name}.__init__", obj.__init__, obj.__doc__
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield f"{name}.{attr}", member, member.__doc__
        elif callable(obj):
            yield name, obj, obj.__doc__
    for name in ("summary", "profile", "to_dot"):
        if hasattr(diagnostics, name):
            fn = getattr(diagnostics, name)
            yield f"diagnostics.{name}", fn, fn.__doc__


def parameters(fn):
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p for p in signature.parameters.values() if p.name not in ("self", "cls")]


CALLABLES = [pytest.param(fn, doc, id=name) for name, fn, doc in public_callables() if parameters(fn)]
OPTIONS_OBJECTS = ("CaptureOptions.__init__", "RunnerOptions.__init__")  # the objects long signatures are grouped into


@pytest.mark.parametrize("fn, doc", CALLABLES)
def test_every_public_parameter_is_typed_and_documented(fn, doc):
    params = parameters(fn)
    untyped = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    assert not untyped, f"parameters without a type: {untyped}"
    assert doc and "Arguments:" in doc, "no Arguments: block"
    block = doc.split("Arguments:", 1)[1]
    undocumented = [p.name for p in params if p.name not in block]
    assert not undocumented, f"parameters the Arguments: block does not name: {undocumented}"


@pytest.mark.parametrize("fn, doc", [param for param in CALLABLES if param.id not in OPTIONS_OBJECTS])
def test_no_public_signature_is_longer_than_about_ten_parameters(fn, doc):
    assert len(parameters(fn)) <= MAX_PARAMETERS

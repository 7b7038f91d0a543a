"""The typed path of a request: from the chat-completions handler to `Program.decode`, every
hand-off between the gateway, the Engine, its worker and the Program names its type (no `Any`),
so a reader or a tool can follow it. Annotations are resolved as a type checker would (names
imported under TYPE_CHECKING included)."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing

from ninfer_jax import api
from ninfer_jax.engine import core, request
from ninfer_jax.engine.admission import Admission
from ninfer_jax.engine.catalog import CatalogEntry
from ninfer_jax.engine.publication import Publication
from ninfer_jax.engine.retention import Retention
from ninfer_jax.engine.rounds import Rounds
from ninfer_jax.engine.tiers import ContextTiers
from ninfer_jax.engine.transactions import ResourceResult, RunningTransaction
from ninfer_jax.frontend.loading import Frontend
from ninfer_jax.frontend.output_session import OutputSession
from ninfer_jax.frontend.prompt import PreparedPrompt
from ninfer_jax.gateway import server
from ninfer_jax.gateway.http import choices, generation, metrics, openai_api, state
from ninfer_jax.program.host import HostProgram
from ninfer_jax.program.pending import PendingBatch, SequenceHandle
from ninfer_jax.program.program import Program
from ninfer_jax.testing import FakeProgram


def hints(obj) -> dict:
    module = inspect.getmodule(obj)
    return typing.get_type_hints(obj, globalns=vars(module), localns=_checking_names(module))


def _checking_names(module) -> dict:
    """The names a module imports under `if TYPE_CHECKING:`, imported."""
    names: dict = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imported in node.body:
                source = importlib.import_module(imported.module)
                names.update({a.asname or a.name: getattr(source, a.name) for a in imported.names})
    return names


def test_the_gateway_hands_requests_to_a_typed_engine():
    assert hints(openai_api.complete)["state"] is state.ServerState
    assert hints(choices.start_choices)["state"] is state.ServerState
    assert hints(state.ServerState)["engine"] is api.Engine
    for fn in (generation.prepare, generation.submit, server.create_app, server.serve,
               metrics.Metrics.__init__):
        assert hints(fn)["engine"] is api.Engine, fn.__qualname__
    assert hints(generation.submit)["prepared"] is PreparedPrompt
    assert typing.get_args(hints(generation.prepare)["return"])[0] is PreparedPrompt


def test_the_engine_drives_a_typed_worker_and_program():
    assert hints(api.Engine.__init__)["core"] == core.EngineCore | None
    assert hints(api.Engine._generation)["return"] is core.EngineCore
    init = hints(core.EngineCore.__init__)
    assert init["program"] is HostProgram and init["frontend"] is Frontend
    assert hints(core.EngineCore.submit)["prompt"] is PreparedPrompt
    for owner in (Admission, Retention):
        assert hints(owner.__init__)["program"] is HostProgram, owner
    assert hints(Publication.__init__) and hints(Rounds.__init__)
    record = hints(request.RequestRecord)
    assert record["prompt"] is PreparedPrompt and record["session"] is OutputSession
    assert record["seq"] == SequenceHandle | None
    # The worker's decode round goes to HostProgram.decode, which both Programs inherit.
    assert issubclass(Program, HostProgram) and issubclass(FakeProgram, HostProgram)
    assert Program.decode is HostProgram.decode
    assert hints(HostProgram.decode)["return"] is PendingBatch


def test_no_any_at_the_engine_and_gateway_boundaries():
    typed = [api.Engine.__init__, core.EngineCore.__init__, core.EngineCore.submit,
             state.ServerState, generation.prepare, generation.submit, server.create_app,
             server.serve, metrics.Metrics.__init__, request.RequestRecord,
             Admission.__init__, Retention.__init__, ResourceResult, RunningTransaction,
             CatalogEntry, ContextTiers.offload]
    for obj in typed:
        for name, hint in hints(obj).items():
            assert typing.Any not in (hint, *typing.get_args(hint)), \
                f"{obj.__qualname__}: {name} is Any"

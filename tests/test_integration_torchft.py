"""torchft live recovery through ``register_ema``: a replica group that dies and restarts
gets its EMA shards back from the peer with its group rank, bit for bit.

Two replica groups x 2 ranks (CPU, gloo), FSDP2 inside each group, the EMA sharded over the
group; torchft 0.2.0's default async quorum; the lighthouse runs in this process. Group A
trains throughout. Group B dies at the top of a step (both ranks ``os._exit``) and restarts;
the restarted group dies again after the quorum of a later step, before its optimizer step
(A's all-reduce then fails, so A skips that step), and restarts again. Every restarted
group starts from another seed and another update count, so its fresh EMA differs from A's
until it heals. Checked, per rank, against A's record of every committed step:

* each incarnation of B, once healed, holds the EMA shards, update count and model shards
  of the same rank of A at the same step, bit for bit;
* A's EMA equals a reference written here (plain ``lerp`` of the model's shards after each
  committed step, from the model's shards at construction): the skipped step updated
  nothing, and the update count is the number of committed steps;
* beside it, an EMA registered by hand and updated after every ``optimizer.step()`` (the
  recipe without the integration) took one update too many: on the skipped step.

Run once over torchft's HTTP transport and once over its process-group transport. Every
server binds 127.0.0.1 only (the loopback patches live here, in the test); every wait has a
deadline. The unit tests below check, without torchft's servers, that only committed steps
update, and the async-quorum safety: a state taken while another thread updates the EMA,
and serialized after training went on, is a committed EMA.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from dist_harness import require_extra

require_extra("torchft", "torchft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_harness import spawn_ranks  # noqa: E402
from torch import nn  # noqa: E402

from dtensor_ema import ModelEMA, MultiModelEMA  # noqa: E402
from dtensor_ema.integrations.torchft import register_ema  # noqa: E402

DECAY = 0.75  # constant (tau=None): the reference needs no schedule
DIED = 17  # exit code of a group the test kills
GROUP = 2  # ranks per replica group
TOP_KILL, QUORUM_KILL, STEPS = 2, 4, 6  # committed steps at each kill; everyone stops at STEPS
ENV = {"GLOO_SOCKET_IFNAME": "lo", "RUST_LOG": "warn"}
"""The ranks' environment: gloo on the loopback interface; torchft's Rust servers log
warnings only (they read ``RUST_LOG`` when the rank first imports torchft, which is why
this module imports torchft inside functions only)."""
INCARNATION_DEADLINE_S = 120.0  # hangs only: an incarnation takes a few seconds


class Net(nn.Module):
    """Odd sizes: uneven shards at W=2."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


# ---------------------------------------------------------------------------- the ranks
def _loopback_torchft() -> None:
    """Keep torchft's servers on 127.0.0.1: torchft 0.2.0 binds its manager server to
    ``[::]`` and its HTTP checkpoint server to ``""`` (every interface), with no knob."""
    import socket
    from http.server import ThreadingHTTPServer

    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager_module

    server = manager_module.ManagerServer

    def loopback_server(**kwargs: Any) -> Any:
        return server(**{**kwargs, "bind": "127.0.0.1:0", "hostname": "127.0.0.1"})

    class LoopbackHTTPServer(ThreadingHTTPServer):
        address_family = socket.AF_INET

        def __init__(self, address: Any, handler: Any) -> None:
            super().__init__(("127.0.0.1", address[1]), handler)

    manager_module.ManagerServer = loopback_server
    http_transport._IPv6HTTPServer = LoopbackHTTPServer  # type: ignore[misc]


def _transport(kind: str, pg: Any, timeout: timedelta) -> Any:
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    if kind == "pg":
        return PGTransport(pg, timeout=timeout, device=torch.device("cpu"))

    class LoopbackHTTPTransport(HTTPTransport):  # type: ignore[misc]
        """Names its host 127.0.0.1 (torchft 0.2.0 uses ``socket.gethostname()``)."""

        def address(self) -> str:
            return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"

    return LoopbackHTTPTransport(timeout=timeout, num_chunks=0)


def _locals(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: t.to_local().detach().clone() for k, t in tensors.items()}


def _manager(rank: int, world: int, plan: dict[str, Any], lighthouse: str) -> tuple[Any, Any]:
    """This rank's ``torchft.Manager`` (async quorum: torchft's default), and the TCP store
    it uses, which group rank 0 hosts on 127.0.0.1 (``None`` on the other ranks); a new
    store for every incarnation."""
    import torchft

    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    timeout = timedelta(seconds=20)
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        rank=rank,
        world_size=world,
        store_addr="127.0.0.1",
        store_port=port[0],
        lighthouse_addr=lighthouse,
        replica_id=f"group_{plan['replica']}",
        hostname="127.0.0.1",
        checkpoint_transport=_transport(plan["transport"], pg, timeout),
        init_sync=False,  # the first incarnations start equal (one seed)
        timeout=timeout,
        quorum_timeout=timedelta(seconds=40),
        connect_timeout=timeout,
    )
    return manager, store


def _train(rank: int, world: int, plan: dict[str, Any], lighthouse: str, out: str) -> None:
    """One rank of one incarnation of a replica group (see the module docstring). Writes
    its report to ``out``; a killed group writes it, then ``os._exit(DIED)``."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft.optim import OptimizerWrapper

    logging.getLogger("torchft").setLevel(logging.CRITICAL)  # the injected deaths' tracebacks
    _loopback_torchft()
    torch.manual_seed(plan["seed"])
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    for layer in (model.body[0], model.body[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())  # the sharded parameters, captured once
    manager, _store = _manager(rank, world, plan, lighthouse)

    @torch.no_grad()
    def load_model(state: dict[str, Any]) -> None:
        for k, p in params.items():
            p.to_local().copy_(state[k].to_local())

    manager.register_state_dict_fn("model", load_model, lambda: dict(params))
    ema = ModelEMA(model, mesh, decay=DECAY, tau=None, updates=plan["updates"])
    naive = ModelEMA(model, mesh, decay=DECAY, tau=None, updates=plan["updates"])
    optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    register_ema(manager, ema, optimizer)  # the integration: one call
    manager.register_state_dict_fn("naive", naive.load_state_dict, naive.state_dict)

    def state() -> dict[str, Any]:
        return {
            "ema": _locals(ema.state_dict()["ema"]),
            "updates": ema.updates,
            "model": _locals(params),
            "naive": _locals(naive.state_dict()["ema"]),
            "naive_updates": naive.updates,
        }

    report: dict[str, Any] = {"fresh": state(), "record": {}, "skipped": []}

    def finish(code: int | None) -> None:
        report.update(final=state(), step=manager.current_step())
        torch.save(report, Path(out, f"{plan['name']}_{rank}.pt"))
        if code is not None:
            os._exit(code)  # the group dies: no cleanup, as a crash
        manager.shutdown(wait=False)

    healthy = plan["replica"] == 0  # group A: never heals, records every committed step
    if healthy:
        report["record"][0] = state()
    while manager.current_step() < STEPS:
        step = manager.current_step()
        if plan["die"] == ("top", step):
            finish(DIED)
        optimizer.zero_grad()  # starts the quorum (async: in torchft's quorum thread)
        g = torch.Generator().manual_seed(1000 * step + 10 * plan["replica"] + rank)
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        if plan["die"] == ("quorum", step):
            manager.wait_quorum()
            finish(DIED)
        grads = [p.grad.to_local() for p in params.values()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()  # the mean over the participating groups
        for g, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(averaged.view_as(g))
        before = state() if healthy else None
        optimizer.step()  # steps (and updates `ema`) only when the step is committed
        naive.update()  # what a loop does without the integration
        if not healthy:
            continue
        if manager.current_step() == step + 1:
            report["record"][step + 1] = state()
        else:
            report["skipped"].append({"step": step, "before": before, "after": state()})
    finish(None)


# ---------------------------------------------------------------------------- the run
def _incarnations(
    plans: list[dict[str, Any]], lighthouse: str, tmp_path: Path, out: str
) -> list[list[str]]:
    """Run group B's incarnations one after the other; each one's failures."""
    return [
        spawn_ranks(
            _train,
            GROUP,
            tmp_path,
            plan,
            lighthouse,
            out,
            deadline_s=INCARNATION_DEADLINE_S,
            env=ENV,
            timeout_s=30.0,
        )[1]
        for plan in plans
    ]


def _run(transport: str, tmp_path: Path) -> tuple[dict[str, dict[int, Any]], list[str]]:
    """Both groups, B's three incarnations; ``({name: {rank: report}}, failures)``."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=3000
    )
    lighthouse = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    out = tmp_path / "reports"
    out.mkdir()
    base = {"transport": transport, "seed": 0, "updates": 0, "die": None}
    plans = {
        "A": {**base, "replica": 0},
        "B0": {**base, "replica": 1, "die": ("top", TOP_KILL)},
        "B1": {**base, "replica": 1, "seed": 1, "updates": 101, "die": ("quorum", QUORUM_KILL)},
        "B2": {**base, "replica": 1, "seed": 2, "updates": 202},
    }
    plans = {name: {**plan, "name": name} for name, plan in plans.items()}
    b = [plans["B0"], plans["B1"], plans["B2"]]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            run_a = pool.submit(
                spawn_ranks,
                _train,
                GROUP,
                tmp_path,
                plans["A"],
                lighthouse,
                str(out),
                deadline_s=2 * INCARNATION_DEADLINE_S,
                env=ENV,
                timeout_s=30.0,
            )
            run_b = pool.submit(_incarnations, b, lighthouse, tmp_path, str(out))
            failures = run_a.result()[1] + [f for run in run_b.result() for f in run]
    finally:
        server.shutdown()
    died = f"exited with code {DIED} and no result"
    unexpected = [f for f in failures if died not in f]
    assert len(failures) - len(unexpected) == 2 * GROUP, f"B0 and B1 must die: {failures}"
    reports = {
        name: {
            rank: torch.load(out / f"{name}_{rank}.pt", weights_only=False)
            for rank in range(GROUP)
            if (out / f"{name}_{rank}.pt").exists()
        }
        for name in plans
    }
    return reports, unexpected


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "pg"])
def test_a_restarted_group_heals_its_ema_from_the_same_rank(transport: str, tmp_path: Path) -> None:
    reports, failures = _run(transport, tmp_path)
    assert not failures, "\n".join(failures)
    for name in reports:
        assert sorted(reports[name]) == list(range(GROUP)), f"{name}: reports {sorted(reports)}"
    for rank in range(GROUP):
        a = reports["A"][rank]
        record = a["record"]
        assert sorted(record) == list(range(STEPS + 1))

        # A: the reference, written here; the skipped step updated nothing
        ref = {k: v.clone() for k, v in record[0]["model"].items()}
        assert _equal(record[0]["ema"], ref), "the EMA starts as a copy of the model"
        for step in range(1, STEPS + 1):
            for k in ref:
                ref[k] = torch.lerp(ref[k], record[step]["model"][k], 1 - DECAY)
            assert _equal(record[step]["ema"], ref), f"rank {rank}: A's EMA at step {step}"
            assert record[step]["updates"] == step
        assert [s["step"] for s in a["skipped"]] == [QUORUM_KILL], a["skipped"]
        skip = a["skipped"][0]
        assert _equal(skip["after"]["ema"], skip["before"]["ema"])
        assert skip["after"]["updates"] == skip["before"]["updates"] == QUORUM_KILL

        # every incarnation of B: A's state of the same rank at the same step, bit for bit
        for name, step in (("B0", TOP_KILL), ("B1", QUORUM_KILL), ("B2", STEPS)):
            b = reports[name][rank]
            assert b["step"] == step, f"{name} rank {rank} stopped at step {b['step']}"
            for key in ("ema", "model"):
                assert _equal(b["final"][key], record[step][key]), f"{name} rank {rank} {key}"
            assert b["final"]["updates"] == step
        for name, healed_at, updates in (("B1", TOP_KILL, 101), ("B2", QUORUM_KILL, 202)):
            fresh = reports[name][rank]["fresh"]
            assert fresh["updates"] == updates
            assert not any(torch.equal(fresh["ema"][k], record[healed_at]["ema"][k]) for k in ref)

        # without the integration: the EMA updated after every optimizer.step() took the
        # skipped step too (one update too many, values off the committed trajectory)
        final = a["final"]
        assert final["naive_updates"] == STEPS + 1
        assert not _equal(final["naive"], ref)


# ---------------------------------------------------------------------------- unit tests
class _Manager:
    """What ``register_ema`` and ``OptimizerWrapper`` use of ``torchft.Manager``, with
    torchft 0.2.0's behaviour (``torchft/manager.py``): ``should_commit()`` increments the
    committed-step count when it says yes; a key registers once (an assertion)."""

    def __init__(self, commits: list[bool] | None = None) -> None:
        self.step = 0
        self.commits = iter(commits or [])
        self.fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], state: Callable[[], Any]
    ) -> None:
        assert key not in self.fns
        self.fns[key] = (load, state)

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        pass

    def should_commit(self) -> bool:
        commit = next(self.commits)
        self.step += commit
        return commit


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))


def _ema_tensors(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ema.state_dict()["ema"].items()}


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[Any]:
    """``steps`` training steps; the model's state after each, for the reference."""
    states = []
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.full((2, 4), float(step))).square().sum().backward()
        optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def test_only_committed_steps_update_the_ema() -> None:
    """Through torchft's ``OptimizerWrapper`` (the hook on the optimizer it wraps), through
    an optimizer container whose ``step()`` calls the wrapper, which calls it again (as
    torchtitan's ``TorchFTOptimizersContainer`` does: the hook runs on every outer call
    and again inside committed ones), and by hand: the EMA follows the committed steps."""
    from torchft.optim import OptimizerWrapper

    commits = [True, False, True, True, False, True]
    committed = [i for i, c in enumerate(commits) if c]

    def reference(states: list[Any], start: dict[str, torch.Tensor]) -> dict[str, Any]:
        ref = dict(start)
        for i in committed:
            ref = {k: torch.lerp(v, states[i][k], 1 - DECAY) for k, v in ref.items()}
        return ref

    # torchft's OptimizerWrapper
    manager, model = _Manager(commits), _net(0)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    start = _ema_tensors(ema)
    optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    register_ema(manager, ema, optimizer)
    states = _train_steps(model, optimizer, len(commits))
    assert ema.updates == len(committed)
    assert _equal(_ema_tensors(ema), reference(states, start))

    # a container that steps through the wrapper (torchtitan's torchft optimizer)
    class Container(torch.optim.SGD):
        wrapper: OptimizerWrapper
        inside = False

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            if self.inside:
                super().step()
                return
            self.inside = True
            try:
                self.wrapper.step()
            finally:
                self.inside = False

    manager, model = _Manager(commits), _net(0)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    container = Container(model.parameters(), lr=0.1)
    container.wrapper = OptimizerWrapper(manager, container)
    register_ema(manager, ema, container)
    states = _train_steps(model, container, len(commits))
    assert ema.updates == len(committed)
    assert _equal(_ema_tensors(ema), reference(states, start))

    # by hand: update() after every step, a no-op unless a step was committed since
    manager, model = _Manager(commits), _net(0)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = register_ema(manager, ema)
    wrapper = OptimizerWrapper(manager, inner)
    done = []
    for _ in commits:
        _train_steps(model, wrapper, 1)
        done.append(handle.update())
        assert not handle.update(), "a second call for one step updates nothing"
    assert done == commits


def test_torchtitans_torchft_optimizer_updates_once_per_committed_step() -> None:
    """torchtitan 0.3.0's ``TorchFTOptimizersContainer`` steps through torchft's wrapper,
    which steps the container again when the step is committed: a post-hook on it runs
    twice per committed step and once per skipped one. ``register_ema`` on it updates
    once per committed step."""
    pytest.importorskip("torchtitan.experiments.torchft.optimizer")
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    class FTManager:  # torchtitan's TorchFTManager, as the container reads it
        def __init__(self, manager: _Manager) -> None:
            self.manager = manager
            self.use_async_quorum = True

    commits = [True, False, True, True, False]
    manager, model = _Manager(commits), _net(0)
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1})]
    config = TorchFTOptimizersContainer.Config(param_groups=groups, implementation="for-loop")
    container = TorchFTOptimizersContainer(
        config, model_parts=[model], ft_manager=FTManager(manager)
    )
    hook_calls: list[int] = []
    container.register_step_post_hook(lambda *_: hook_calls.append(manager.step))
    ema = ModelEMA(model, decay=DECAY, tau=None)
    register_ema(manager, ema, container)
    _train_steps(model, container, len(commits))
    assert len(hook_calls) == 2 * sum(commits) + (len(commits) - sum(commits))
    assert ema.updates == sum(commits)


class _Pair:
    """Two EMAs updated one after the other (as a ``TorchtitanEMA`` with two decays, or any
    EMA whose update writes tensor after tensor): a state read between the two halves
    would hold one updated and one not."""

    def __init__(self, model: nn.Module) -> None:
        self.a = ModelEMA(model, decay=DECAY, tau=None)
        self.b = ModelEMA(model, decay=DECAY, tau=None)
        self.halfway = threading.Event()
        self.resume = threading.Event()

    def update(self) -> None:
        self.a.update()
        self.halfway.set()
        self.resume.wait(timeout=10)
        self.b.update()

    def state_dict(self) -> dict[str, Any]:
        return {"a": self.a.state_dict(), "b": self.b.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.a.load_state_dict(state["a"])
        self.b.load_state_dict(state["b"])


def test_a_state_taken_during_an_update_is_a_committed_ema() -> None:
    """The manager's quorum thread asks for the state while the training thread is in the
    middle of an update; the transport serializes it later, after training went on (the
    HTTP transport does when the peer asks). What it serializes is the EMA of one
    committed step: both halves at the same count, with that count's values."""
    model = _net(0)
    pair = _Pair(model)
    manager = _Manager()
    handle = register_ema(manager, pair, update=pair.update)
    start = _ema_tensors(pair.a)
    served = manager.fns["ema"][1]  # what torchft calls from its quorum thread

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.step = 1
    updating = threading.Thread(target=handle.update)
    updating.start()
    assert pair.halfway.wait(timeout=10)
    taken: list[Any] = []
    quorum = threading.Thread(target=lambda: taken.append(served()))
    quorum.start()
    quorum.join(timeout=0.2)  # it may not return while the update is half done ...
    pair.resume.set()  # ... so let the update finish
    updating.join(timeout=10)
    quorum.join(timeout=10)
    assert not updating.is_alive() and not quorum.is_alive() and len(taken) == 1
    after_one = {k: torch.lerp(v, model.state_dict()[k], 1 - DECAY) for k, v in start.items()}

    with torch.no_grad():  # training goes on: a second committed step ...
        for p in model.parameters():
            p.add_(1.0)
    manager.step = 2
    pair.resume.set()
    assert handle.update()
    buffer = io.BytesIO()  # ... before the transport serializes the state
    torch.save(taken[0], buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    assert state["a"]["updates"] == state["b"]["updates"] == 1
    assert _equal(state["a"]["ema"], after_one)
    assert _equal(state["b"]["ema"], after_one)
    assert pair.a.updates == pair.b.updates == 2


def test_a_peer_state_heals_a_fresh_ema_and_the_next_commit_updates_it() -> None:
    """What a recovering rank does with a peer's state: a fresh EMA of another model (other
    values, another update count) loads it exactly, a ``MultiModelEMA`` too; the step the
    peer was at counts as updated, the next committed one updates."""
    peer_model, model = _net(0), _net(1)
    for make in (
        lambda m, updates: ModelEMA(m, decay=DECAY, tau=None, updates=updates),
        lambda m, updates: MultiModelEMA(
            m, {"fast": {"decay": 0.5, "tau": None}, "slow": {"decay": DECAY, "tau": None}}
        ),
    ):
        peer_manager, manager = _Manager(), _Manager()
        peer = register_ema(peer_manager, make(peer_model, 3))
        for step in (1, 2):
            peer_manager.step = step
            _train_steps(peer_model, torch.optim.SGD(peer_model.parameters(), lr=0.1), 1)
            assert peer.update()
        sent = peer_manager.fns["ema"][1]()
        fresh = make(model, 50)
        handle = register_ema(manager, fresh)
        assert _flat(fresh.state_dict()) != _flat(sent)
        manager.step = 2  # torchft sets the peer's step before it loads the user state
        manager.fns["ema"][0](sent)
        assert _flat(fresh.state_dict()) == _flat(peer.ema.state_dict())
        assert not handle.update(), "the peer's step is already in the EMA"
        manager.step = 3
        assert handle.update()


def _flat(state: Any) -> Any:
    """A state dict as nested plain values (tensors as lists), for ``==``."""
    if isinstance(state, dict):
        return {k: _flat(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state.tolist()
    return state


def test_the_served_state_shares_no_memory_with_the_ema() -> None:
    model = _net(0)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    manager = _Manager()
    register_ema(manager, ema)
    served = manager.fns["ema"][1]()
    live = ema.state_dict()["ema"]
    for k, v in served["ema"].items():
        assert v.untyped_storage().data_ptr() != live[k].untyped_storage().data_ptr()
        assert torch.equal(v, live[k])


def test_bad_arguments_register_nothing() -> None:
    model = _net(0)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    manager = _Manager()
    with pytest.raises(TypeError, match=r"torchft\.Manager"):
        register_ema(object(), ema)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state_dict"):
        register_ema(manager, object())
    with pytest.raises(TypeError, match="update="):
        register_ema(manager, _NoUpdate())
    with pytest.raises(TypeError, match=r"OptimizerWrapper or a torch\.optim\.Optimizer"):
        register_ema(manager, ema, model)  # type: ignore[arg-type]
    assert manager.fns == {}
    register_ema(manager, ema)
    with pytest.raises(ValueError, match="'ema' is already registered"):
        register_ema(manager, ModelEMA(model), key="ema")
    assert list(manager.fns) == ["ema"]


class _NoUpdate:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

"""Launch the ranks of a run on this machine, watch them, and end the whole run on the first failure.

Each rank is a process running the worker entry point (``python -m shard_planner.execute.worker``), the
one ``torchrun`` runs on several nodes, with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT: a free port). Each starts in its own session, so that
``os.killpg`` ends it together with anything it started: a failed run leaves no process behind.

[Note: naming the failing rank]
Ranks report progress ("step 3") and failures (kind, one-line message) in files in a private run
folder. When one rank raises, the others fail too a moment later, in a collective ("Connection closed
by peer", a gloo timeout): those are *communication* errors, consequences. The launcher names the first
rank whose error is not a communication error. At the run's timeout it asks every rank still running
for its Python stack (faulthandler on SIGUSR1): a rank whose innermost frame is inside
torch.distributed waits in a collective; the first rank that does not is the one that hung, and the
message says where it is. Failing those, the first communication error is named. A rank that dies
without a report (killed, segfault, ``os._exit`` in the model file), or exits 0 before it is done, is
named with its exit status, what it was doing and the model file.

[Note: ending a run on Ctrl-C or SIGTERM]
The ranks run in sessions of their own, so a Ctrl-C in the terminal reaches only the launcher; the
``shard-planner`` entry point turns SIGTERM into an exception too (``cli.main.Terminated``). Either one
unwinds through :func:`launch_local`, whose ``finally`` kills every rank's process group (SIGKILL: no rank
writes anything after it) and removes the run folder, with further signals held until that is done. The
measurement is written by the launcher only after every rank has finished, so an interrupted run leaves
none. A launcher killed outright (SIGKILL) takes its ranks along by PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shard_planner.hardware.allocator_conf import mode_name, rank_environment
from shard_planner.cost.host_share import threads_per_rank, usable_cores
from shard_planner.errors import RunError
from shard_planner.execute.host_memory import HostMemory, available_host_bytes, rank_need_bytes
from shard_planner.plan.measurement import Measurement, RestoreCheck, load_measurement
from shard_planner.plan import Plan, load_plan, resolve_model_file
from shard_planner.process import die_with_parent, exit_status

logger = logging.getLogger(__name__)

POLL_S = 0.1
COMMUNICATION = "communication error"


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when CUDA is available, else "cpu"; "cuda" without CUDA is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda: no CUDA device is available here; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise RunError(f"--device must be cpu, cuda or auto, got {device!r}")
    return device


def resolve_model_path(plan: Plan, plan_path: str | os.PathLike | None = None) -> str:
    """The plan's model file as an absolute path (:func:`shard_planner.plan.resolve_model_file`: beside
    the plan file, or as recorded); an importable ``package.module`` is returned unchanged."""
    return resolve_model_file(plan.model, plan_path)


def collective_timeout_s(timeout_s: float) -> float:
    """Timeout of every collective in a local run: the run's own (the launcher ends a hung run itself;
    see [Note: naming the failing rank])."""
    return timeout_s


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchResult:
    measurements: tuple[Measurement, ...]  # one per plan, in order (none for a resume_from launch)
    pids: tuple[int, ...]  # the rank processes (all ended)
    restore: RestoreCheck | None = None  # a resume_from launch's comparison


class _World:
    """The rank processes of one run, and their reports."""

    def __init__(self, run_dir: Path, world_size: int, worker_args: list[str], model_paths: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None, host: HostMemory | None = None):
        self.run_dir = run_dir
        self.host = host  # a CPU run's host memory at launch, named when a rank is killed (SIGKILL)
        self.extra_env = dict(extra_env or {})  # added to every rank's environment (the allocator's mode)
        self.world_size = world_size
        self.model_paths = model_paths  # the plans' model files, named when a rank dies without a report
        self.port = free_port()  # not reserved: another process could take it before rank 0 binds it
        self.procs: list[subprocess.Popen] = []
        self.warned: set[int] = set()  # ranks that ended abnormally after finishing (warned once)
        try:
            self._start(worker_args, self.port)
        except BaseException:
            self.kill()  # the ranks already started
            raise

    def _start(self, worker_args: list[str], port: int) -> None:
        world_size, run_dir = self.world_size, self.run_dir
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONUNBUFFERED="1", **self.extra_env)
            if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: ranks must not oversubscribe the cores
                env["OMP_NUM_THREADS"] = str(threads_per_rank(world_size, usable_cores()))
            log = open(run_dir / f"rank{rank}.log", "wb")
            args = [sys.executable, "-m", "shard_planner.execute.worker", *worker_args,
                    "--status-dir", str(run_dir)]
            self.procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True,
                                               preexec_fn=die_with_parent))
            log.close()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs)

    def errors(self) -> dict[int, dict]:
        out = {}
        for rank in range(self.world_size):
            f = self.run_dir / f"rank{rank}.error.json"
            if f.is_file():
                try:
                    out[rank] = dict(json.loads(f.read_text()), mtime=f.stat().st_mtime)
                except (OSError, json.JSONDecodeError):
                    pass  # being written: read it next time
        return out

    def status(self, rank: int) -> str:
        f = self.run_dir / f"rank{rank}.status"
        try:
            return f.read_text() or "starting"
        except OSError:
            return "starting"

    def log_tail(self, rank: int, lines: int = 30) -> str:
        try:
            return "\n".join((self.run_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """End every rank and whatever it started (each rank leads its own process group)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait this long
                logger.error("rank process %d did not end after SIGKILL", p.pid)
        # Children of a rank that left its session are not ours to find; a rank's own process group is
        # gone with SIGKILL above. Reap any leftover member of those groups too.
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _describe_error(rank: int, err: dict) -> str:
    return f"rank {rank} {err['kind']}: {err['message']}"


def _unreported_exit(world: _World, rank: int, code: int) -> str:
    """One line for a rank that ended without reporting an error (see [Note: naming the failing rank])."""
    tail = world.log_tail(rank)
    logger.debug("rank %d output:\n%s", rank, tail)
    last = tail.strip().splitlines()[-1] if tail.strip() else "no output"
    early = " before finishing" if code == 0 else ""
    model = f"model file {', '.join(world.model_paths)}; " if world.model_paths else ""
    oom = f": {world.host.killed_text()}" if code == -signal.SIGKILL and world.host is not None else ""
    return f"rank {rank} {exit_status(code)}{early} during '{world.status(rank)}'{oom} ({model}last output: {last})"


def watch(world: _World, timeout_s: float) -> None:
    """Wait for every rank; raise :class:`RunError` naming the failing rank (see [Note: naming the
    failing rank]). Kills the world on any failure."""
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in world.procs]
        errors = world.errors()
        primary = sorted((e["mtime"], r) for r, e in errors.items() if e["kind"] != COMMUNICATION)
        if primary:
            rank = primary[0][1]
            _debug_tracebacks(world, errors)
            world.kill()
            raise RunError(_describe_error(rank, errors[rank]))
        for rank, code in enumerate(codes):
            if code is None or rank in errors:
                continue
            # "done" is the worker's last status (after the plan label, "plan 3/3: done", with several plans),
            # written once its results are: a rank that dies after it (gloo's threads can abort the
            # interpreter's exit: "terminate called without an active exception") finished its work.
            if not world.status(rank).endswith("done"):
                world.kill()
                raise RunError(_unreported_exit(world, rank, code))
            if code != 0 and rank not in world.warned:
                world.warned.add(rank)
                logger.warning("rank %d %s while exiting, after it had finished and written its results; "
                               "the run's results stand", rank, exit_status(code))
        if all(code is not None for code in codes):
            if errors:  # only communication errors, and everyone has stopped
                rank = min(errors, key=lambda r: errors[r]["mtime"])
                _debug_tracebacks(world, errors)
                raise RunError(_describe_error(rank, errors[rank]))
            return
        if time.monotonic() - start > timeout_s:
            _debug_tracebacks(world, errors)
            message = _timeout_message(world, codes, errors, timeout_s)
            world.kill()
            raise RunError(message)
        time.sleep(POLL_S)


def _timeout_message(world: _World, codes: list, errors: dict[int, dict], timeout_s: float) -> str:
    """Name the hung rank: of the ranks still running with no error, the first one that is not waiting
    inside torch.distributed (read from a stack dump, see :func:`_innermost_frames`)."""
    running = [r for r, code in enumerate(codes) if code is None and r not in errors]
    frames = _innermost_frames(world, running)
    waiting = sorted(set(errors) | {r for r in running if frames.get(r) and _in_collective(frames[r])})
    hung = [r for r in running if r not in waiting]
    if not hung and not running:
        rank = min(errors, key=lambda r: errors[r]["mtime"])
        return f"the run did not finish within --timeout {timeout_s:g} s; {_describe_error(rank, errors[rank])}"
    rank = (hung or running)[0]
    where = f"at '{world.status(rank)}'"
    frame = next((f for f in frames.get(rank, []) if "site-packages" not in f[0] and "/lib/python" not in f[0]),
                 frames.get(rank, [None])[0])
    if frame:
        where += f", in {frame[2]} ({frame[0]}:{frame[1]})"
    others = [r for r in waiting if r != rank]
    also = (f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
            f"{'wait' if len(others) > 1 else 'waits'} for it in a collective" if others else "")
    hint = ""
    if world.status(rank) in ("starting", "init_process_group"):
        hint = (f"; the ranks never met: is MASTER_PORT {world.port} on 127.0.0.1 taken by another process, "
                "or is the machine too loaded to start them in time?")
    return f"rank {rank} hung: the run did not finish within --timeout {timeout_s:g} s ({where}){also}{hint}"


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (\S+)')


def _innermost_frames(world: _World, ranks: list[int], wait_s: float = 3.0) -> dict[int, list[tuple[str, int, str]]]:
    """Ask each rank for its main thread's Python stack (the worker registers faulthandler on SIGUSR1,
    writing to its log) and return the frames, innermost first."""
    sizes = {}
    for r in ranks:
        sizes[r] = _log_size(world, r)
        try:
            os.kill(world.procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    frames: dict[int, list] = {}
    seen: set[int] = set()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(frames) < len(ranks):
        time.sleep(POLL_S)
        for r in ranks:
            text = _log_text(world, r)[sizes[r]:]
            if r in frames or "most recent call first" not in text:
                continue
            if r not in seen:  # parse on the next poll, once the dump is whole
                seen.add(r)
                continue
            frames[r] = _main_thread_frames(text)
    return frames


def _main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
    """From a faulthandler dump of every thread, the frames of the main thread (the one whose
    outermost frame is a module's top level), innermost first."""
    threads, current = [], None
    for line in dump.splitlines():
        if "most recent call first" in line:
            current = []
            threads.append(current)
        elif current is not None and (m := _FRAME.match(line)):
            f, n, fn = m.groups()
            current.append((f, int(n), fn))
    main = [t for t in threads if t and t[-1][2] == "<module>"]
    return (main or threads or [[]])[0]


def _in_collective(frames: list[tuple[str, int, str]]) -> bool:
    return bool(frames) and "torch/distributed" in frames[0][0].replace(os.sep, "/")


def _log_size(world: _World, rank: int) -> int:
    return len(_log_text(world, rank))


def _log_text(world: _World, rank: int) -> str:
    try:
        return (world.run_dir / f"rank{rank}.log").read_text(errors="replace")
    except OSError:
        return ""


def _debug_tracebacks(world: _World, errors: dict[int, dict]) -> None:
    for rank, err in sorted(errors.items()):
        logger.debug("rank %d: %s\n%s", rank, err["kind"], err.get("traceback", ""))


def launch_local(plan_paths: list[str | os.PathLike], *, world_size: int, steps: int, warmup: int,
                 device: str, timeout_s: float, checkpoint_dir: str | None = None, checkpoint_steps: int = 2,
                 resume_from: str | None = None) -> LaunchResult:
    """Run the plans in ``plan_paths``, in turn, in one world of ``world_size`` local ranks; return
    their measurements (written by nobody: the caller decides where they go). Raises
    :class:`RunError` on any failure, with every rank ended. ``checkpoint_dir`` (one plan): save a
    checkpoint there after the measured steps and restore it (worker.RunOptions); ``resume_from`` (one
    plan): only restore that checkpoint at ``world_size`` and compare (``LaunchResult.restore``)."""
    plans = [load_plan(p) for p in plan_paths]
    host = check_before_launch(plans, world_size, device)
    model_paths = tuple(dict.fromkeys(p.model.path for p in plans))
    extra_env = allocator_environment(plans) if device == "cuda" else {}
    run_dir = Path(tempfile.mkdtemp(prefix="shard-planner-run-"))
    world = None
    try:
        worker_args = [*map(str, plan_paths), "--out-dir", str(run_dir), "--steps", str(steps),
                       "--warmup", str(warmup), "--device", device,
                       "--timeout", str(collective_timeout_s(timeout_s)), "--checkpoint-steps", str(checkpoint_steps)]
        worker_args += ["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir else []
        worker_args += ["--resume-from", str(resume_from)] if resume_from else []
        world = _World(run_dir, world_size, worker_args, model_paths, extra_env, host)
        logger.info("launched %d ranks: pids %s", world_size, world.pids)
        try:
            watch(world, timeout_s)
        except RunError as exc:
            exc.pids = world.pids
            raise
        if resume_from:
            return LaunchResult((), world.pids, _read_restore(run_dir / "measurement-0.json"))
        measurements = []
        for i in range(len(plan_paths)):
            out = run_dir / f"measurement-{i}.json"
            if not out.is_file():
                raise RunError(f"rank 0 finished without writing the measurement of plan {i + 1}")
            measurements.append(load_measurement(out))
        return LaunchResult(tuple(measurements), world.pids)
    finally:  # See [Note: ending a run on Ctrl-C or SIGTERM]
        with _signals_held():
            if world is not None:
                world.kill()  # a no-op when every rank has exited; the safety net on any other way out
            shutil.rmtree(run_dir, ignore_errors=True)


def check_before_launch(plans: list[Plan], world_size: int, device: str) -> HostMemory | None:
    """Before any rank starts: every plan checked against its model (load/checked_plan.py [Note: A plan checked
    against its model]) and, on CPU, the ranks' host memory against what the machine has
    (execute/host_memory.py [Note: A CPU run's host memory]), which is returned (None on GPU)."""
    from shard_planner.load.checked_plan import built_bytes, check_plan

    models = [check_plan(p) for p in plans]  # each model built once on the meta device (memoized)
    if device != "cpu":
        return None
    host = HostMemory(max(rank_need_bytes(p, built_bytes(m), world_size) for p, m in zip(plans, models)),
                      world_size, available_host_bytes())
    host.check()
    return host


def allocator_environment(plans: list[Plan]) -> dict[str, str]:
    """The CUDA allocator setting the ranks get for ``plans`` (one launch, one setting: the first plan's);
    see shard_planner/hardware/allocator_conf.py [Note: The allocator mode a plan runs with]."""
    modes = {p.cluster.expandable_segments for p in plans}
    if len(modes) > 1:
        logger.warning("these plans were made for different CUDA allocator modes; one launch runs them all "
                       "with the first plan's (%s)", mode_name(plans[0].cluster.expandable_segments))
    env, warning = rank_environment(plans[0].cluster.expandable_segments, os.environ)
    if warning:
        logger.warning("%s", warning)
    return env


def _read_restore(path: Path) -> RestoreCheck:
    if not path.is_file():
        raise RunError("rank 0 finished without writing the restore's comparison")
    return RestoreCheck(**json.loads(path.read_text()))


@contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM (a second Ctrl-C) until the block is done, then act on them as before.
    Only the main thread handles signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(held):
            if callable(previous[s]):
                previous[s](s, None)
            elif previous[s] == signal.SIG_DFL:
                signal.raise_signal(s)

"""GPU health backends (docs/design.md, Health): real NVML and a simulated one with fault injection.

The backend is chosen by ``settings.agent_nvml_backend`` ("real" | "simulated"),
never silently: asking for the real backend where NVML is missing raises
``NvmlUnavailable`` with the reason.

Real backend (``NvmlBackend``, nvidia-ml-py's ``pynvml``):
  * every field is read on its own; NVML "not supported" (and "function not found"
    on older drivers, "no permission") leaves the field unset instead of failing;
  * health per GPU: FAILED on a fatal Xid (``settings.fatal_xids``), a double-bit
    (uncorrected) ECC error, a row-remapping failure, an NVLink that was up at
    start and is down now, or "GPU is lost"; DEGRADED on hardware slowdown /
    thermal throttling or a pending row remap; OK otherwise;
  * Xid and ECC events come from an NVML event set read by a background thread.

Simulated backend (``SimulatedBackend``): utilization follows the ranks the agent
runs on each GPU; faults are injected in-process (``inject``) or by appending JSON
lines to the node's ``faults.jsonl`` (``write_fault``, used by
``gpufleet agent inject-fault``): ``xid``, ``ecc`` ("sbe" | "dbe"), ``hang``
(utilization 0 and the ranks' steps freeze), ``slow`` (a factor < 1), ``link``
(NVLink down), ``clear``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from worker_agent import statefiles as sf

log = logging.getLogger("gpufleet.agent.nvml")

OK, DEGRADED, FAILED, UNKNOWN = "ok", "degraded", "failed", "unknown"
XID_HISTORY = 16


class NvmlUnavailable(RuntimeError):
    """The real NVML backend was asked for, but NVML cannot be used on this host."""


@dataclass
class GpuSample:
    index: int
    health: str = UNKNOWN
    uuid: str = ""
    sm_util: float | None = None
    mem_util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    temperature_c: float | None = None
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    xids: list[int] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)


def classify(
    s: GpuSample, fatal_xids: Iterable[int], *, failed: list[str] | None = None, degraded: list[str] | None = None
) -> GpuSample:
    """Set ``s.health`` and ``s.faults`` from what was read."""
    fatal = set(fatal_xids)
    bad = list(failed or [])
    meh = list(degraded or [])
    for x in dict.fromkeys(s.xids):
        (bad if x in fatal else meh).append(f"xid:{x}")
    if s.ecc_dbe:
        bad.append(f"ecc:dbe={s.ecc_dbe}")
    s.faults = bad + meh
    s.health = FAILED if bad else DEGRADED if meh else OK
    return s


class GpuBackend(Protocol):
    name: str

    def gpu_count(self) -> int: ...
    def sample(self) -> list[GpuSample]: ...
    def set_busy(self, gpus: set[int]) -> None: ...
    def hung_gpus(self) -> set[int]: ...
    def poll_faults(self) -> bool: ...
    def close(self) -> None: ...


# --------------------------------------------------------------------------- real


def _load_pynvml():
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailable("the real NVML backend needs nvidia-ml-py (import pynvml failed)") from e
    return pynvml


class NvmlBackend:
    """GPU health from NVML (nvidia-ml-py). Thread-safe: NVML itself is."""

    name = "real"

    def __init__(self, fatal_xids: Iterable[int], *, nvml: Any = None, events: bool = True) -> None:
        self.nv = nvml or _load_pynvml()
        self.fatal_xids = list(fatal_xids)
        nv = self.nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise NvmlUnavailable(
                f"NVML is not usable on this host ({type(e).__name__}: {e}); "
                "set GPUFLEET_AGENT_NVML_BACKEND=simulated to run without GPUs"
            ) from e
        self._quiet = tuple(
            getattr(nv, n)
            for n in ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")
            if hasattr(nv, n)
        )
        self._lost = getattr(nv, "NVMLError_GpuIsLost", None)
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            raise NvmlUnavailable(f"NVML cannot count GPUs ({type(e).__name__}: {e})") from e
        self.handles: list[Any] = []
        self.handle_errors: dict[int, str] = {}
        for i in range(count):
            try:
                self.handles.append(nv.nvmlDeviceGetHandleByIndex(i))
            except nv.NVMLError as e:  # e.g. a GPU lost before we started: report it failed
                self.handles.append(None)
                self.handle_errors[i] = f"nvml:handle:{e}"
        self.uuids = [
            (self._field(functools.partial(_uuid, nv, h), []) or "") if h is not None else "" for h in self.handles
        ]
        self._xids: list[deque[int]] = [deque(maxlen=XID_HISTORY) for _ in self.handles]
        self._links_up: list[list[int]] = [self._active_links(h) if h is not None else [] for h in self.handles]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set = None
        if events:
            self._start_events()

    # -- helpers
    def _field(self, fn: Callable[[], Any], errors: list[str], what: str = "") -> Any:
        """One NVML read: unsupported -> None; other errors -> None plus a note; lost GPU re-raised."""
        try:
            return fn()
        except self._quiet:
            return None
        except AttributeError:  # this nvidia-ml-py has no such function: not supported
            return None
        except self.nv.NVMLError as e:
            if self._lost is not None and isinstance(e, self._lost):
                raise
            errors.append(f"nvml:{what}:{e}")
            return None

    def _active_links(self, h) -> list[int]:
        nv = self.nv
        up = []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) == getattr(nv, "NVML_FEATURE_ENABLED", 1):
                    up.append(link)
            except nv.NVMLError:
                continue
        return up

    def _start_events(self) -> None:
        nv = self.nv
        wanted = 0
        for name in ("nvmlEventTypeXidCriticalError", "nvmlEventTypeDoubleBitEccError"):
            wanted |= getattr(nv, name, 0)
        try:
            es = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.warning("NVML events unavailable (%s): Xids only through health polling", e)
            return
        registered = 0
        for i, h in enumerate(self.handles):
            if h is None:
                continue
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(h)
            except nv.NVMLError:
                supported = wanted
            mask = wanted & supported
            if not mask:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(h, mask, es)
                registered += 1
            except nv.NVMLError as e:
                log.warning("GPU %d: cannot register NVML events (%s)", i, e)
        if not registered:
            try:
                nv.nvmlEventSetFree(es)
            except nv.NVMLError:
                pass
            return
        self._event_set = es
        self._thread = threading.Thread(target=self._event_loop, name="nvml-events", daemon=True)
        self._thread.start()

    def _event_loop(self) -> None:
        nv = self.nv
        xid_type = getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)
        timeout_cls = getattr(nv, "NVMLError_Timeout", None)
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 1000)
            except nv.NVMLError as e:
                if timeout_cls is not None and isinstance(e, timeout_cls):
                    continue
                log.warning("NVML event wait failed (%s); retrying", e)
                self._stop.wait(1.0)
                continue
            try:
                idx = nv.nvmlDeviceGetIndex(data.device)
            except nv.NVMLError:
                continue
            if data.eventType & xid_type and 0 <= idx < len(self._xids):
                with self._lock:
                    self._xids[idx].append(int(data.eventData))
                log.error("GPU %d: Xid %d", idx, data.eventData)

    # -- GpuBackend
    def gpu_count(self) -> int:
        return len(self.handles)

    def sample(self) -> list[GpuSample]:
        return [self._sample_one(i, h) for i, h in enumerate(self.handles)]

    def _sample_one(self, i: int, h) -> GpuSample:
        nv = self.nv
        s = GpuSample(index=i, uuid=self.uuids[i])
        if h is None:
            return classify(s, self.fatal_xids, failed=[self.handle_errors.get(i, "nvml:no handle")])
        errors: list[str] = []
        failed: list[str] = []
        degraded: list[str] = []
        try:
            util = self._field(lambda: nv.nvmlDeviceGetUtilizationRates(h), errors, "utilization")
            if util is not None:
                s.sm_util, s.mem_util = float(util.gpu), float(util.memory)
            mem = self._field(lambda: nv.nvmlDeviceGetMemoryInfo(h), errors, "memory")
            if mem is not None:
                s.mem_used, s.mem_total = int(mem.used), int(mem.total)
            temp_fn = getattr(nv, "nvmlDeviceGetTemperature", None) or nv.nvmlDeviceGetTemperatureV
            t = self._field(lambda: temp_fn(h, nv.NVML_TEMPERATURE_GPU), errors, "temperature")
            t = getattr(t, "temperature", t)  # nvmlDeviceGetTemperatureV returns a struct
            s.temperature_c = None if t is None else float(t)
            s.ecc_dbe = self._field(
                lambda: int(
                    nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
                ),
                errors,
                "ecc_dbe",
            )
            s.ecc_sbe = self._field(
                lambda: int(
                    nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
                ),
                errors,
                "ecc_sbe",
            )
            remap = self._field(lambda: nv.nvmlDeviceGetRemappedRows(h), errors, "remapped_rows")
            if remap is not None:
                _corr, _unc, pending, failure = remap
                if failure:
                    failed.append("row-remap:failed")
                elif pending:
                    degraded.append("row-remap:pending")
            reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
            )
            if reasons_fn is not None:
                reasons = self._field(lambda: reasons_fn(h), errors, "clock_reasons")
                if reasons:
                    for name, bit in (
                        ("hw-slowdown", 0x8),
                        ("sw-thermal", 0x20),
                        ("hw-thermal", 0x40),
                        ("power-brake", 0x80),
                    ):
                        if reasons & bit:
                            degraded.append(f"throttle:{name}")
            for link in self._links_up[i]:
                state = self._field(functools.partial(nv.nvmlDeviceGetNvLinkState, h, link), errors, f"nvlink{link}")
                if state is not None and state != getattr(nv, "NVML_FEATURE_ENABLED", 1):
                    failed.append(f"nvlink:{link}:down")
        except nv.NVMLError as e:  # GPU is lost
            failed.append(f"gpu-lost:{e}")
        with self._lock:
            s.xids = list(self._xids[i])
        classify(s, self.fatal_xids, failed=failed, degraded=degraded)
        s.faults += errors  # informational: a field failed to read
        return s

    def set_busy(self, gpus: set[int]) -> None:
        pass

    def hung_gpus(self) -> set[int]:
        return set()

    def poll_faults(self) -> bool:
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._event_set is not None:
            try:
                self.nv.nvmlEventSetFree(self._event_set)
            except self.nv.NVMLError:
                pass
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _uuid(nv: Any, handle: Any) -> str:
    return _s(nv.nvmlDeviceGetUUID(handle))


# ---------------------------------------------------------------------- simulated


@dataclass
class _SimGpu:
    xids: deque = field(default_factory=lambda: deque(maxlen=XID_HISTORY))
    sbe: int = 0
    dbe: int = 0
    hang: bool = False
    slow: float | None = None
    links_down: set = field(default_factory=set)


class SimulatedBackend:
    """A node's GPUs without hardware: deterministic utilization, injectable faults."""

    name = "simulated"

    def __init__(
        self, n_gpus: int = 8, *, fatal_xids: Iterable[int] = (), fault_file: Path | None = None, node_id: str = "sim"
    ) -> None:
        self.n = n_gpus
        self.node_id = node_id
        self.fatal_xids = list(fatal_xids)
        self.fault_file = fault_file
        self._offset = 0
        self._gpus = [_SimGpu() for _ in range(n_gpus)]
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        if fault_file is not None and fault_file.exists():
            self.poll_faults()  # faults injected before we started still apply

    def inject(self, gpu: int | None = None, *, xid: int | None = None, ecc: str | None = None, hang: bool = False,
               slow: float | None = None, link: int | None = None, clear: bool = False) -> None:  # fmt: skip
        with self._lock:
            targets = range(self.n) if gpu is None else [gpu]
            for g in targets:
                if not 0 <= g < self.n:
                    raise ValueError(f"{self.node_id} has no GPU {g}")
                sim = self._gpus[g]
                if clear:
                    self._gpus[g] = _SimGpu()
                    continue
                if xid is not None:
                    sim.xids.append(int(xid))
                if ecc == "sbe":
                    sim.sbe += 1
                elif ecc == "dbe":
                    sim.dbe += 1
                elif ecc is not None:
                    raise ValueError("ecc is 'sbe' or 'dbe'")
                if hang:
                    sim.hang = True
                if slow is not None:
                    sim.slow = float(slow)
                if link is not None:
                    sim.links_down.add(int(link))

    def poll_faults(self) -> bool:
        """Apply faults appended to the fault file since the last call; True if any."""
        if self.fault_file is None:
            return False
        try:
            size = self.fault_file.stat().st_size
        except OSError:
            return False
        if size <= self._offset:
            return False
        with open(self.fault_file, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1  # only complete lines
        self._offset += end
        applied = False
        for line in data[:end].splitlines():
            try:
                fault = json.loads(line)
                self.inject(
                    fault.get("gpu"),
                    xid=fault.get("xid"),
                    ecc=fault.get("ecc"),
                    hang=bool(fault.get("hang")),
                    slow=fault.get("slow"),
                    link=fault.get("link"),
                    clear=bool(fault.get("clear")),
                )
                applied = True
            except (ValueError, TypeError) as e:
                log.warning("%s: ignoring bad fault line %r: %s", self.node_id, line[:200], e)
        return applied

    def gpu_count(self) -> int:
        return self.n

    def set_busy(self, gpus: set[int]) -> None:
        with self._lock:
            self._busy = set(gpus)

    def hung_gpus(self) -> set[int]:
        with self._lock:
            return {i for i, g in enumerate(self._gpus) if g.hang}

    def sample(self) -> list[GpuSample]:
        self.poll_faults()
        out = []
        tick = int((time.monotonic() - self._t0) / 5)
        total = 80 * 2**30
        with self._lock:
            for i, g in enumerate(self._gpus):
                busy = i in self._busy
                util = float(90 + (i * 7 + tick) % 9) if busy else 0.0
                degraded = []
                if g.slow is not None:
                    util = round(util * g.slow, 1)
                    degraded.append(f"slow:{g.slow}")
                if g.hang:
                    util = 0.0
                s = GpuSample(
                    index=i,
                    uuid=f"GPU-sim-{self.node_id}-{i}",
                    sm_util=util,
                    mem_util=round(util * 0.6, 1),
                    mem_used=int(total * 0.7) if busy else 512 * 2**20,
                    mem_total=total,
                    temperature_c=(66.0 if busy else 34.0) + (12.0 if g.slow is not None else 0.0),
                    ecc_sbe=g.sbe,
                    ecc_dbe=g.dbe,
                    xids=list(g.xids),
                )
                failed = [f"nvlink:{link}:down" for link in sorted(g.links_down)]
                if g.sbe >= 100:
                    degraded.append(f"ecc:sbe={g.sbe}")
                out.append(classify(s, self.fatal_xids, failed=failed, degraded=degraded))
        return out

    def close(self) -> None:
        pass


def write_fault(state_dir: Path | str, node_id: str, **fault: Any) -> Path:
    """Append one fault for the simulated backend of ``node_id`` (picked up at its next sample)."""
    path = sf.node_dir(state_dir, node_id) / sf.FAULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({k: v for k, v in fault.items() if v is not None and v is not False}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def make_backend(settings, node_id: str, kind: str | None = None) -> GpuBackend:
    kind = kind or settings.agent_nvml_backend
    if kind == "real":
        return NvmlBackend(settings.fatal_xids)
    if kind == "simulated":
        fault_file = sf.node_dir(settings.state_dir, node_id) / sf.FAULTS
        return SimulatedBackend(
            settings.demo_gpus_per_node, fatal_xids=settings.fatal_xids, fault_file=fault_file, node_id=node_id
        )
    raise ValueError(f"unknown NVML backend {kind!r} (expected 'real' or 'simulated')")


def _main() -> int:
    """`python -m worker_agent.nvml [real|simulated]`: one sample of every GPU as JSON (a check on a GPU host)."""
    import dataclasses
    import sys

    kind = sys.argv[1] if len(sys.argv) > 1 else "real"
    try:
        backend: GpuBackend = NvmlBackend([48, 63, 64, 74, 79, 94, 95]) if kind == "real" else SimulatedBackend(8)
    except NvmlUnavailable as e:
        print(f"nvml: {e}", file=sys.stderr)
        return 2
    try:
        time.sleep(0.5)  # let the event thread register
        print(
            json.dumps({"backend": backend.name, "gpus": [dataclasses.asdict(s) for s in backend.sample()]}, indent=2)
        )
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

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

Readings per GPU: utilization (NVML's "a kernel ran" share of time), SM activity (the
share of SMs busy, from GPU performance monitoring where the GPU has it: Hopper and later),
memory, temperature, power, ECC counts, Xids.

Simulated backend (``SimulatedBackend``): a GPU's utilization follows the CPU time its
ranks' processes (and their children) really spend, measured between samples (one busy core
reads 100%); memory, temperature and power follow it; faults are injected in-process (``inject``) or by appending JSON
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
    power_w: float | None = None
    sm_active: float | None = None  # % of SMs busy (GPM); None where the GPU cannot say
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    xids: list[int] = field(default_factory=list)  # the latest XID_HISTORY Xids
    xid_count: int = 0  # every Xid seen since the backend started (the history above is capped)
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
    # the minor number of the GPU's device node (/dev/nvidia<minor>); None: unknown
    def device_minor(self, index: int) -> int | None: ...
    def sample(self) -> list[GpuSample]: ...
    # the pids of the rank processes on each GPU (GPU index -> pids), as of now
    def set_ranks(self, ranks: dict[int, list[int]]) -> None: ...
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
        # which /dev/nvidiaN each GPU is: NVML's index follows PCI order, the minor need not
        self.minors: list[int | None] = [self._minor(h) for h in self.handles]
        self._xids: list[deque[int]] = [deque(maxlen=XID_HISTORY) for _ in self.handles]
        self._xid_counts = [0 for _ in self.handles]
        # SM activity needs two GPM samples: the previous one per GPU (None: none yet or no GPM)
        self._gpm = [self._gpm_supported(h) if h is not None else False for h in self.handles]
        self._gpm_prev: list[Any] = [None for _ in self.handles]
        self._gpm_lock = threading.Lock()  # the previous-sample slots are shared by concurrent samples
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

    def _minor(self, h) -> int | None:
        """The GPU's device minor number; None where NVML cannot say (a lost GPU included)."""
        if h is None:
            return None
        try:
            return self._field(functools.partial(self.nv.nvmlDeviceGetMinorNumber, h), [])
        except self.nv.NVMLError:
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

    def _gpm_supported(self, h) -> bool:
        try:
            support = self._field(lambda: self.nv.nvmlGpmQueryDeviceSupport(h), [])
        except self.nv.NVMLError:  # a GPU lost already: its samples say so
            return False
        return bool(getattr(support, "isSupportedDevice", 0))

    def _gpm_free(self, sample: Any) -> None:
        try:
            self.nv.nvmlGpmSampleFree(sample)
        except (self.nv.NVMLError, AttributeError):
            pass

    def _sm_active(self, i: int, h, errors: list[str]) -> float | None:
        """SM activity (%) between the previous GPM sample of this GPU and one taken now."""
        nv = self.nv
        if not self._gpm[i]:
            return None
        with self._gpm_lock:
            new = self._field(lambda: nv.nvmlGpmSampleAlloc(), errors, "gpm_alloc")
            if new is None:
                return None
            try:
                got = self._field(lambda: nv.nvmlGpmSampleGet(h, new), errors, "gpm_sample")
            except nv.NVMLError:  # the GPU is lost: the caller reports it
                self._gpm_free(new)
                raise
            if got is None:
                self._gpm_free(new)
                return None
            prev, self._gpm_prev[i] = self._gpm_prev[i], new
        if prev is None:
            return None  # the first sample: no interval yet
        try:
            req = nv.c_nvmlGpmMetricsGet_t()
            req.version = nv.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = 1
            req.sample1, req.sample2 = prev, new
            req.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
            res = self._field(lambda: nv.nvmlGpmMetricsGet(req), errors, "gpm_metrics")
            if res is None or res.metrics[0].nvmlReturn != getattr(nv, "NVML_SUCCESS", 0):
                return None
            return max(0.0, min(100.0, float(res.metrics[0].value)))
        finally:
            self._gpm_free(prev)

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
                    self._xid_counts[idx] += 1
                log.error("GPU %d: Xid %d", idx, data.eventData)

    # -- GpuBackend
    def gpu_count(self) -> int:
        return len(self.handles)

    def device_minor(self, index: int) -> int | None:
        m = self.minors[index] if 0 <= index < len(self.minors) else None
        return int(m) if m is not None else None

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
            mw = self._field(lambda: nv.nvmlDeviceGetPowerUsage(h), errors, "power")
            s.power_w = None if mw is None else float(mw) / 1000.0
            s.sm_active = self._sm_active(i, h, errors)
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
            s.xid_count = self._xid_counts[i]
        classify(s, self.fatal_xids, failed=failed, degraded=degraded)
        s.faults += errors  # informational: a field failed to read
        return s

    def set_ranks(self, ranks: dict[int, list[int]]) -> None:
        pass  # NVML measures the GPUs themselves

    def hung_gpus(self) -> set[int]:
        return set()

    def poll_faults(self) -> bool:
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._gpm_lock:
            for i, prev in enumerate(self._gpm_prev):
                if prev is not None:
                    self._gpm_free(prev)
                    self._gpm_prev[i] = None
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


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
CPU_WINDOW_S = 0.5  # the least time a CPU-use rate is measured over (clock ticks are 10 ms: 2% steps)
SIM_MEM_TOTAL = 80 * 2**30
SIM_MEM_IDLE = 512 * 2**20
SIM_POWER_IDLE_W, SIM_POWER_MAX_W = 70.0, 700.0  # an H100 SXM at idle and at its board limit
SIM_TEMP_IDLE_C, SIM_TEMP_MAX_C = 34.0, 70.0


def _proc_cpu(pid: int) -> tuple[int, float] | None:
    """(start ticks, CPU seconds of the process and of its children it has reaped); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()  # comm may hold spaces and parentheses
    try:
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])  # fields 14-17
        return int(rest[19]), (utime + stime + cutime + cstime) * _TICK_S
    except (IndexError, ValueError):
        return None


def _proc_children(pid: int) -> list[int]:
    """Live children of ``pid`` (each thread lists those it forked; needs CONFIG_PROC_CHILDREN)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def process_tree_cpu(pid: int) -> tuple[int, float] | None:
    """CPU seconds spent by ``pid`` and every descendant, live or reaped, with ``pid``'s start
    ticks (a reused pid is another process); None if ``pid`` is gone."""
    top = _proc_cpu(pid)
    if top is None:
        return None
    total = top[1]
    seen = {pid}
    todo = _proc_children(pid)
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        got = _proc_cpu(c)
        if got is not None:
            total += got[1]
            todo.extend(_proc_children(c))
    return top[0], total


@dataclass
class _CpuMark:
    start: int
    cpu_s: float
    at: float
    rate: float = 0.0  # CPU seconds per second over the latest window (1.0: one core busy)


@dataclass
class _SimGpu:
    xids: deque = field(default_factory=lambda: deque(maxlen=XID_HISTORY))
    xid_count: int = 0
    sbe: int = 0
    dbe: int = 0
    hang: bool = False
    slow: float | None = None
    links_down: set = field(default_factory=set)


class SimulatedBackend:
    """A node's GPUs without hardware: use measured from the ranks' CPU time, injectable faults.

    Each GPU's utilization is the CPU use of the rank processes on it (``set_ranks``), one
    busy core being 100%: a rank that sleeps reads about 0, one that computes reads busy, so
    what operators see (and what idle and hang detection judge) follows what the rank does.
    """

    name = "simulated"

    def __init__(
        self,
        n_gpus: int = 8,
        *,
        fatal_xids: Iterable[int] = (),
        fault_file: Path | None = None,
        node_id: str = "sim",
        cpu_reader: Callable[[int], tuple[int, float] | None] = process_tree_cpu,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.n = n_gpus
        self.node_id = node_id
        self.fatal_xids = list(fatal_xids)
        self.fault_file = fault_file
        self._offset = 0
        self._gpus = [_SimGpu() for _ in range(n_gpus)]
        self._ranks: dict[int, list[int]] = {}
        self._cpu: dict[int, _CpuMark] = {}
        self._cpu_reader = cpu_reader
        self._clock = clock
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()  # the CPU marks: one sample at a time
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
                    sim.xid_count += 1
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

    def device_minor(self, index: int) -> int | None:
        return index if 0 <= index < self.n else None  # a simulated node's GPUs are nvidia0..n-1

    def set_ranks(self, ranks: dict[int, list[int]]) -> None:
        with self._lock:
            self._ranks = {g: list(pids) for g, pids in ranks.items() if 0 <= g < self.n}
        # a new rank's first mark now, not at the next sample: a short rank (a burn-in) is
        # measured within its life
        now = self._clock()
        with self._sample_lock:
            for pid in {p for pids in ranks.values() for p in pids} - set(self._cpu):
                got = self._cpu_reader(pid)
                if got is not None:
                    self._cpu[pid] = _CpuMark(got[0], got[1], now)

    def hung_gpus(self) -> set[int]:
        with self._lock:
            return {i for i, g in enumerate(self._gpus) if g.hang}

    def _cpu_rates(self, pids: set[int]) -> dict[int, float]:
        """Each pid's CPU use (cores) over its latest window of at least CPU_WINDOW_S.

        A pid reads 0 until a window has passed since its first mark (taken by ``set_ranks``)."""
        now = self._clock()
        with self._sample_lock:
            for pid in set(self._cpu) - pids:
                del self._cpu[pid]
            out = {}
            for pid in pids:
                got = self._cpu_reader(pid)
                if got is None:
                    self._cpu.pop(pid, None)
                    out[pid] = 0.0
                    continue
                start, cpu_s = got
                m = self._cpu.get(pid)
                if m is None or m.start != start:
                    self._cpu[pid] = _CpuMark(start, cpu_s, now)
                    out[pid] = 0.0
                    continue
                if now - m.at >= CPU_WINDOW_S:
                    m.rate = max(0.0, (cpu_s - m.cpu_s) / (now - m.at))
                    m.cpu_s, m.at = cpu_s, now
                out[pid] = m.rate
            return out

    def sample(self) -> list[GpuSample]:
        self.poll_faults()
        with self._lock:
            ranks = {g: list(p) for g, p in self._ranks.items()}
        rates = self._cpu_rates({p for pids in ranks.values() for p in pids})
        out = []
        with self._lock:
            for i, g in enumerate(self._gpus):
                util = min(100.0, 100.0 * sum(rates.get(p, 0.0) for p in ranks.get(i, ())))
                degraded = []
                if g.slow is not None:
                    util *= g.slow
                    degraded.append(f"slow:{g.slow}")
                if g.hang:
                    util = 0.0
                util = round(util, 1)
                load = util / 100.0
                used = SIM_MEM_IDLE + int((0.7 * SIM_MEM_TOTAL - SIM_MEM_IDLE) * load)
                s = GpuSample(
                    index=i,
                    uuid=f"GPU-sim-{self.node_id}-{i}",
                    sm_util=util,
                    sm_active=round(util * 0.8, 1),  # SMs are not all busy while a kernel runs
                    mem_util=round(util * 0.6, 1),
                    mem_used=used,
                    mem_total=SIM_MEM_TOTAL,
                    temperature_c=round(SIM_TEMP_IDLE_C + (SIM_TEMP_MAX_C - SIM_TEMP_IDLE_C) * load, 1)
                    + (12.0 if g.slow is not None else 0.0),
                    power_w=round(SIM_POWER_IDLE_W + (SIM_POWER_MAX_W - SIM_POWER_IDLE_W) * load, 1),
                    ecc_sbe=g.sbe,
                    ecc_dbe=g.dbe,
                    xids=list(g.xids),
                    xid_count=g.xid_count,
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

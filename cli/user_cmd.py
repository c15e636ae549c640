"""The user commands of `gpufleet`: submit, status, list, events, logs, cancel, extend,
explain, queue, quota get|set, classes get|set, nodes, drain, return-node.

They talk HTTP to the API (never to Temporal or Postgres). The URL and token come
from ``--url`` / ``--token`` or the settings (``GPUFLEET_API_URL``, ``GPUFLEET_TOKEN``).
Every write sends an Idempotency-Key generated once per invocation and reused on
each retry, so a retry after a timeout never submits (or cancels) twice. A request that
reached no API (connection refused or reset, the API died mid-request, 502/503/504, or its key
still in flight on another API process) is retried with backoff for ``client_retry_s``
(GPUFLEET_CLIENT_RETRY_S, 30 s), reads and writes alike: with two API processes on one
address, one dying costs a caller a retry, never an error or a second job.
``--json`` prints the API's JSON for scripts; otherwise rich tables.

Exit codes: 0 ok, 1 the API refused (its error code and sentence on stderr),
3 the API could not be reached; ``submit --wait`` exits with the job's outcome
(WAIT_EXIT_CODES). ``status --watch`` and ``list --watch`` redraw every
WATCH_INTERVAL_S seconds (rich Live) until Ctrl-C (``status --watch``: or the job ends).
Tables are as wide as their content when stdout is not a terminal (never cut at 80 columns).
"""

from __future__ import annotations

import json
import random
import ssl
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table

RETRY_STATUSES = {502, 503, 504}
# the backoff between attempts (each drawn in [d/2, d]); the last repeats until client_retry_s has passed
RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0)
WATCH_INTERVAL_S = 2.0  # --watch and --wait poll the API this often
PIPED_WIDTH = 10_000  # a table written to a pipe or file is as wide as its content
TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT")
# submit --wait: the process's exit code is the job's outcome
WAIT_EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 10, "CANCELLED": 11, "TIMED_OUT": 12}
WAIT_INTERRUPTED = 130  # Ctrl-C while waiting: the job keeps running

Url = Annotated[str | None, typer.Option("--url", help="API base URL (default: GPUFLEET_API_URL)", show_default=False)]
Token = Annotated[
    str | None, typer.Option("--token", help="bearer token (default: GPUFLEET_TOKEN)", show_default=False)
]
AsJson = Annotated[bool, typer.Option("--json", help="print the API's JSON")]
YourTeam = Annotated[str | None, typer.Argument(help="default: your team")]


class CliError(Exception):
    def __init__(self, message: str, code: str = "", exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.exit_code = exit_code


def _out() -> Console:
    """Rich output: the terminal's width (at least 120), or unbounded when stdout is piped."""
    if not _is_tty():
        return Console(soft_wrap=False, width=PIPED_WIDTH)
    return Console(soft_wrap=False, width=max(Console().width, 120))


def _is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _err(message: str) -> None:
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()


def resolve(url: str | None, token: str | None) -> tuple[str, str | None]:
    if url and token:
        return url.rstrip("/"), token
    from common.settings import Settings

    try:
        s = Settings()
    except Exception as e:  # an invalid GPUFLEET_* variable: say which, briefly
        raise CliError(f"invalid settings: {str(e).splitlines()[0]}", exit_code=2) from e
    from common.tls import api_scheme

    base = url or s.api_url or f"{api_scheme(s)}://{s.api_host}:{s.api_port}"
    return base.rstrip("/"), token or s.token


class ApiClient:
    """A small synchronous client: retries with backoff for ``retry_s``, one idempotency key per call."""

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout: float = 30.0,
        retry_s: float | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.url = url
        self.token = token
        self.verify = verify  # an https API's certificate is checked against this (common.tls.client_verify)
        self.timeout = timeout
        self.retry_s = _default_retry_s() if retry_s is None else retry_s
        self.retries: list[str] = []  # why each retry this client made happened, in order

    def _headers(self, key: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": "gpufleet-cli"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        if key:
            h["Idempotency-Key"] = key
        return h

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        write: bool = False,
        key: str | None = None,
    ) -> Any:
        """One call to the API. A write carries ``key`` (or one made here) on every attempt, so
        whichever API process an attempt reaches, and whether or not an earlier attempt's work
        committed before its process died, the API does it once and replays its answer."""
        key = (key or f"cli-{uuid.uuid4()}") if write else None  # one key per invocation, reused on retry
        params = {k: v for k, v in (params or {}).items() if v is not None}
        deadline = time.monotonic() + self.retry_s
        last: Exception | None = None
        attempt = 0
        while True:
            if attempt:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS)) - 1]
                time.sleep(min(left, random.uniform(delay / 2, delay)))
                self.retries.append(_why(last))
            attempt += 1
            try:
                with httpx.Client(timeout=self.timeout, verify=self.verify) as client:
                    r = client.request(
                        method, self.url + path, json=json_body, params=params, headers=self._headers(key)
                    )
            except httpx.UnsupportedProtocol as e:  # a URL no retry can mend
                raise CliError(f"cannot reach the API at {self.url}: {e}", code="unreachable", exit_code=3) from e
            except httpx.TransportError as e:  # refused, reset, or the process died mid-request
                _raise_if_untrusted(self.url, e)
                last = e
                continue
            if r.status_code in RETRY_STATUSES or (r.status_code == 409 and _code(r) == "idempotency_key_in_flight"):
                last = _api_error(r)
                continue
            if r.status_code >= 400:
                raise _api_error(r)
            return r.json() if r.content else None
        if isinstance(last, CliError):
            raise last
        raise CliError(f"cannot reach the API at {self.url}: {last}", code="unreachable", exit_code=3)

    def stream(self, path: str, params: dict[str, Any]) -> Iterator[bytes]:
        """Yield a streamed body; after a dropped connection, resume from the bytes received."""
        received = 0
        failures = 0
        while True:
            q = {k: v for k, v in params.items() if v is not None} | {"offset": params.get("offset", 0) + received}
            try:
                with httpx.Client(timeout=httpx.Timeout(self.timeout, read=None), verify=self.verify) as client:
                    with client.stream("GET", self.url + path, params=q, headers=self._headers()) as r:
                        if r.status_code >= 400:
                            r.read()
                            raise _api_error(r)
                        for chunk in r.iter_raw():
                            received += len(chunk)
                            yield chunk
                return
            except httpx.TransportError as e:
                _raise_if_untrusted(self.url, e)
                failures += 1
                if failures > len(RETRY_DELAYS):
                    raise CliError(f"lost the log stream from {self.url}: {e}", code="unreachable", exit_code=3) from e
                time.sleep(RETRY_DELAYS[failures - 1])


def _why(e: Exception | None) -> str:
    """A retry's reason, short: the transport error's type or the API's error code."""
    if isinstance(e, CliError):
        return e.code or "error"
    return type(e).__name__


def _code(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""


def _api_error(r: httpx.Response) -> CliError:
    try:
        err = r.json()["error"]
        return CliError(
            f"{err['message']}{_fields(err.get('details'))} [{err['code']}, HTTP {r.status_code}]", code=err["code"]
        )
    except (ValueError, KeyError, TypeError):
        return CliError(f"HTTP {r.status_code} from the API: {r.text[:200]}", code=f"http_{r.status_code}")


def _fields(details: Any) -> str:
    """A validation error's fields, as ': topology: <why>; replicas: <why>' (nothing otherwise)."""
    if not isinstance(details, list):
        return ""
    parts = []
    for d in details[:5]:
        if isinstance(d, dict) and "msg" in d:
            loc = [str(x) for x in d.get("loc", ()) if str(x) != "body"]
            parts.append(f"{'.'.join(loc) or 'body'}: {d['msg']}")
    return (": " + "; ".join(parts)) if parts else ""


def _run(fn, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except CliError as e:
        _err(f"error: {e.message}")
        raise typer.Exit(e.exit_code) from None


def _client(url: str | None, token: str | None) -> ApiClient:
    base, tok = _run(resolve, url, token)
    return ApiClient(base, tok, retry_s=_retry_s(), verify=_run(_verify))


def _verify() -> ssl.SSLContext | bool:
    """The CA an https API is checked against (tls_ca_file; unset or unloadable settings: the system's)."""
    from common.settings import Settings
    from common.tls import TlsSettingsError, client_verify

    try:
        s = Settings()
    except Exception:
        return True
    try:
        return client_verify(s)
    except TlsSettingsError as e:
        raise CliError(str(e), exit_code=2) from e


def _raise_if_untrusted(url: str, e: Exception) -> None:
    """A certificate this client does not trust is no outage: say so now instead of retrying."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(cause):
            raise CliError(
                f"the API at {url} presented a certificate this client does not trust ({cause});"
                " set GPUFLEET_TLS_CA_FILE to the platform's CA",
                code="untrusted_certificate",
                exit_code=3,
            ) from e
        cause = cause.__cause__ or cause.__context__


def _retry_s() -> float:
    """client_retry_s from the settings (its default when they do not load: ``resolve`` says why
    when it needs them)."""
    from common.settings import Settings

    try:
        return Settings().client_retry_s
    except Exception:
        return _default_retry_s()


def _default_retry_s() -> float:
    from common.settings import Settings

    return float(Settings.model_fields["client_retry_s"].default)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v) or "-"
    return str(v)


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    for k, v in rows:
        t.add_row(k, _fmt(v))
    return t


def _when(v: Any) -> datetime | None:
    if not v:
        return None
    try:
        at = datetime.fromisoformat(str(v))
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _duration(seconds: float | None) -> str:
    """2h05m, 4m07s, 9s; '-' when unknown."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s >= 86_400:
        return f"{s // 86_400}d{s % 86_400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _elapsed_s(j: dict[str, Any], now: datetime | None = None) -> float | None:
    """Seconds the job has run (to its end, once it ended); None before it started."""
    started = _when(j.get("started_at"))
    if started is None:
        return None
    end = _when(j.get("finished_at")) or now or datetime.now(UTC)
    return (end - started).total_seconds()


def _time_left_s(j: dict[str, Any], now: datetime | None = None) -> float | None:
    """max_runtime minus elapsed, for a job that runs; None otherwise."""
    elapsed = _elapsed_s(j, now)
    if elapsed is None or j.get("max_runtime_s") is None or j["state"] in TERMINAL_STATES:
        return None
    return max(0.0, float(j["max_runtime_s"]) - elapsed)


def _nodes(nodes: list[str] | None, show: int = 3) -> str:
    if not nodes:
        return "-"
    more = f" +{len(nodes) - show}" if len(nodes) > show else ""
    return ", ".join(nodes[:show]) + more


def _watch(
    fetch: Callable[[], Any],
    render: Callable[[Any], RenderableType],
    *,
    as_json: bool,
    done: Callable[[Any], bool] = lambda _: False,
) -> Any:
    """Redraw ``render(fetch())`` every WATCH_INTERVAL_S seconds until ``done`` or Ctrl-C (exit 0).
    With --json, one JSON document per line per refresh; piped, one table per refresh.
    Returns the last value fetched."""
    value = fetch()
    try:
        if as_json or not _is_tty():
            con = _out()
            while True:
                if as_json:
                    sys.stdout.write(json.dumps(value, default=str) + "\n")
                    sys.stdout.flush()
                else:
                    con.print(render(value))
                if done(value):
                    return value
                time.sleep(WATCH_INTERVAL_S)
                value = fetch()
        with Live(render(value), console=_out(), auto_refresh=False, transient=False) as live:
            while not done(value):
                time.sleep(WATCH_INTERVAL_S)
                value = fetch()
                live.update(render(value), refresh=True)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends the watch, not the job
    return value


# --- commands ---------------------------------------------------------------------------


def submit(
    file: Annotated[Path, typer.Option("-f", "--file", help="job spec (YAML or JSON); - reads stdin")],
    idempotency_key: Annotated[
        str | None, typer.Option("--idempotency-key", help="reuse a key to retry an earlier submit safely")
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="wait for the job to end, printing its state changes; the exit code is its outcome:"
            " 0 SUCCEEDED, 10 FAILED, 11 CANCELLED, 12 TIMED_OUT (1: the API refused, 3: unreachable,"
            " 130: Ctrl-C, the job keeps running)",
        ),
    ] = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Submit a job from a YAML file (the shape of POST /v1/jobs; see examples/)."""
    try:
        text = sys.stdin.read() if str(file) == "-" else file.read_text()
        spec = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as e:
        _err(f"error: cannot read {file}: {e}")
        raise typer.Exit(2) from None
    if isinstance(spec, dict) and set(spec) == {"job"} and isinstance(spec["job"], dict):
        spec = spec["job"]
    if not isinstance(spec, dict):
        _err(f"error: {file} must hold a mapping of job fields")
        raise typer.Exit(2)
    api = _client(url, token)
    r = _run(api.request, "POST", "/v1/jobs", json_body=spec, write=True, key=idempotency_key)
    if as_json and not wait:
        return _print_json(r)
    if not as_json:
        pos = r.get("queue_position")
        where = f", position {pos}" + (" (estimate)" if r.get("queue_position_estimated") else "") if pos else ""
        _out().print(f"submitted [bold]{r['job_id']}[/bold] ({r['state']}{where})")
    if wait:
        raise typer.Exit(_wait_for(api, r["job_id"], as_json=as_json))


def _wait_for(api: ApiClient, job_id: str, *, as_json: bool) -> int:
    """Poll the job until it ends; print each state change (or, with --json, the final job).
    Returns the exit code for its outcome (WAIT_EXIT_CODES)."""
    con = _out()
    seen: tuple[str, int] | None = None
    try:
        while True:
            j = _run(api.request, "GET", f"/v1/jobs/{job_id}")
            now = (j["state"], j["attempt"])
            if now != seen and not as_json:
                seen = now
                con.print(f"{job_id}: {_state_line(j)}", highlight=False)
            if j["state"] in TERMINAL_STATES:
                if as_json:
                    _print_json(j)
                return WAIT_EXIT_CODES.get(j["state"], 1)
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        _err(f"stopped waiting; {job_id} keeps running (gpufleet status {job_id} --watch, or cancel {job_id})")
        return WAIT_INTERRUPTED


def _state_line(j: dict[str, Any]) -> str:
    """RUNNING (attempt 1) on b0-n0, b0-n1; QUEUED (position 3: capacity); SUCCEEDED (exit 0, 4m07s)."""
    state, parts = j["state"], []
    if j.get("attempt", 1) > 1:
        parts.append(f"attempt {j['attempt']}")
    if state == "QUEUED":
        if j.get("queue_position"):
            parts.append(f"position {j['queue_position']}")
        if j.get("pending_reason"):
            parts.append(str(j["pending_reason"]))
    if state in TERMINAL_STATES:
        if j.get("exit_code") is not None:
            parts.append(f"exit {j['exit_code']}")
        if _elapsed_s(j) is not None:
            parts.append(f"ran {_duration(_elapsed_s(j))}")
    line = state + (f" ({', '.join(parts)})" if parts else "")
    nodes = (j.get("allocation") or {}).get("nodes") or j.get("nodes")
    if nodes and state not in (*TERMINAL_STATES, "QUEUED"):
        line += f" on {_nodes(nodes)}"
    return line


def status(
    job_id: str,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="redraw every 2 s until the job ends or Ctrl-C")] = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A job's state, attempt, allocation and queue position."""
    api = _client(url, token)
    if watch:
        _watch(
            lambda: _run(api.request, "GET", f"/v1/jobs/{job_id}"),
            _status_view,
            as_json=as_json,
            done=lambda j: j["state"] in TERMINAL_STATES,
        )
        return
    j = _run(api.request, "GET", f"/v1/jobs/{job_id}")
    if as_json:
        return _print_json(j)
    _out().print(_status_view(j))


def _status_view(j: dict[str, Any]) -> Table:
    """The status table of one job (GET /v1/jobs/{id})."""
    rows = [
        ("job", j["job_id"]),
        ("name", j.get("name")),
        ("team", j["team"]),
        ("class", j["priority_class"]),
        ("state", j["state"]),
        ("attempt", j["attempt"]),
        ("gpus", f"{j['replicas']} x {j['gpus_per_replica']} {j['gpu_type']}"),
        ("submitted", j["submitted_at"]),
        ("started", j.get("started_at")),
        ("nodes", j["allocation"]["nodes"]),
        ("blocks", j["allocation"]["blocks"]),
        ("last checkpoint", j.get("last_checkpoint")),
        ("preemptions", j["preemptions"]),
    ]
    if j["state"] == "QUEUED":
        rows += [("queue position", j.get("queue_position")), ("pending", j.get("pending_reason"))]
    use = j.get("gpu_use")
    if use:
        util = "no reading yet" if use["gpu_util"] is None else f"{use['gpu_util']:.0f}% SM"
        idle = f"; allocated but idle since {use['idle_since']}" if use["idle"] else ""
        rows.append(("gpu use", f"{util} over {use['gpus']} GPUs{idle}"))
    if j.get("finished_at") or j.get("exit_code") is not None:
        rows += [("finished", j.get("finished_at")), ("exit code", j.get("exit_code"))]
    rows += _failure_rows(j.get("failure"))
    return _kv_table(f"job {j['job_id']}", rows)


def _failure_rows(f: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """Why the latest ended attempt did not succeed (``failure`` in the API's answers)."""
    if not f:
        return []
    rows: list[tuple[str, Any]] = [("ended", f"attempt {f['attempt']}: {f['kind']}")]
    if f.get("rank") is not None:
        how = f["state"].lower() if f.get("state") else "-"
        code = f", exit code {f['exit_code']}" if f.get("exit_code") is not None else ""
        rows.append(("failing rank", f"rank {f['rank']} on {f['node_id']} ({how}{code})"))
    if f.get("signal") is not None:
        rows.append(("signal", f"{f['signal']} ({f.get('signal_name') or '?'})"))
    if f.get("reason") and f["reason"] not in f["retry"]:
        rows.append(("reason", escape(f["reason"])))
    if f.get("stderr_tail"):
        rows.append(("stderr (last lines)", escape(f["stderr_tail"].rstrip("\n"))))
    rows.append(("will retry", escape(f["retry"])))
    return rows


def list_jobs(
    team: Annotated[str | None, typer.Option(help="team (admins: any; default: all you may see)")] = None,
    state: Annotated[str | None, typer.Option(help="only jobs in this state (QUEUED, RUNNING, ...)")] = None,
    limit: Annotated[int, typer.Option(help="jobs per page")] = 50,
    all_pages: Annotated[bool, typer.Option("--all", help="follow every page")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="redraw every 2 s until Ctrl-C")] = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """List jobs, newest first: state, elapsed, time left, nodes, and why queued ones wait."""
    api = _client(url, token)

    def fetch() -> dict[str, Any]:
        jobs: list[dict] = []
        cursor = None
        while True:
            page = _run(
                api.request,
                "GET",
                "/v1/jobs",
                params={"team": team, "state": state, "limit": limit, "cursor": cursor},
            )
            jobs += page["jobs"]
            cursor = page.get("next_cursor")
            if not (all_pages and cursor):
                break
        return {"jobs": jobs, "next_cursor": cursor}

    if watch:
        _watch(fetch, _jobs_view, as_json=as_json)
        return
    page = fetch()
    if as_json:
        return _print_json(page)
    _out().print(_jobs_view(page))


def _jobs_view(page: dict[str, Any]) -> RenderableType:
    now = datetime.now(UTC)
    t = Table(
        "job",
        "name",
        "team",
        "class",
        "gpus",
        "state",
        "attempt",
        "position",
        "submitted",
        "elapsed",
        "left",
        "nodes",
        "reason",
    )
    for j in page["jobs"]:
        t.add_row(
            j["job_id"],
            _fmt(j.get("name")),
            j["team"],
            j["priority_class"],
            str(j["gpus"]),
            j["state"],
            str(j["attempt"]),
            _fmt(j.get("queue_position")),
            str(j["submitted_at"])[:19],
            _duration(_elapsed_s(j, now)),
            _duration(_time_left_s(j, now)),
            _nodes(j.get("nodes")),
            _fmt(j.get("pending_reason")),
        )
    if page.get("next_cursor"):
        t.caption = f"more: --all, or the API's cursor {page['next_cursor']}"
        t.caption_justify = "left"
    return t


def events(job_id: str, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """A job's timeline (submitted, scheduled, preempted, node_failed, restarted, ...)."""
    api = _client(url, token)
    out: list[dict] = []
    cursor = None
    while True:
        page = _run(api.request, "GET", f"/v1/jobs/{job_id}/events", params={"cursor": cursor})
        out += page["events"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    if as_json:
        return _print_json({"job_id": job_id, "events": out})
    t = Table("at", "attempt", "event", "from", "to", "actor", "reason")
    for e in out:
        t.add_row(
            str(e["at"])[:19],
            str(e["attempt"]),
            e["event"],
            _fmt(e.get("from_state")),
            _fmt(e.get("to_state")),
            e["actor"],
            _fmt(e.get("reason")),
        )
    _out().print(t)


def logs(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("-f", "--follow", help="keep streaming new output until the job's ranks end")
    ] = False,
    stream: Annotated[
        str,
        typer.Option(
            "--stream", help="stdout, stderr, or all (both, interleaved by time, each line prefixed with its stream)"
        ),
    ] = "all",
    rank: Annotated[int | None, typer.Option(help="which rank (default 0)", show_default=False)] = None,
    all_ranks: Annotated[
        bool, typer.Option("--all-ranks", help="every rank, merged by time, each line prefixed with its rank")
    ] = False,
    tail: Annotated[int | None, typer.Option("--tail", help="only the last N lines", show_default=False)] = None,
    attempt: Annotated[int | None, typer.Option(help="which attempt (default: the newest)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object a line: rank, stream, time, line")] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """The job's output: a rank's stdout and stderr (proxied from the agent on its node)."""
    if stream not in ("stdout", "stderr", "all"):
        _err(f"error: --stream is stdout, stderr or all, not {stream!r}")
        raise typer.Exit(2)
    if all_ranks and rank is not None:
        _err("error: --rank and --all-ranks: choose one")
        raise typer.Exit(2)
    if tail is not None and tail < 0:
        _err("error: --tail takes a number of lines, 0 or more")
        raise typer.Exit(2)
    api = _client(url, token)
    params = {
        "rank": rank,
        "all_ranks": "true" if all_ranks else None,
        "stream": stream,
        "tail": tail,
        "format": "ndjson" if as_json else "text",
        "attempt": attempt,
        "follow": "true" if follow else "false",
        "offset": 0,
    }
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    try:
        for chunk in api.stream(f"/v1/jobs/{job_id}/logs", params):
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
    except CliError as e:
        _err(f"error: {e.message}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def cancel(
    job_id: str,
    reason: Annotated[str, typer.Option(help="recorded in the audit trail")] = "cancelled by user",
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Cancel a job (its ranks are stopped; the job ends CANCELLED)."""
    r = _run(_client(url, token).request, "DELETE", f"/v1/jobs/{job_id}", params={"reason": reason}, write=True)
    if as_json:
        return _print_json(r)
    _out().print(f"{r['job_id']}: {r['state']}")


def extend(
    job_id: str,
    by: Annotated[str, typer.Option(help='how much longer, e.g. "2h"')],
    reason: Annotated[str, typer.Option(help="why (audited)")] = "",
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Ask for more runtime (extensions are capped in number and size)."""
    r = _run(
        _client(url, token).request,
        "POST",
        f"/v1/jobs/{job_id}:extend",
        json_body={"by": by, "reason": reason},
        write=True,
    )
    if as_json:
        return _print_json(r)
    _out().print(f"{job_id}: extended, new deadline {r.get('new_deadline')} ({r['extensions_used']} used)")


def explain(job_id: str, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """Why a job is pending, what it waits for, and its expected start."""
    e = _run(_client(url, token).request, "GET", f"/v1/jobs/{job_id}/explain")
    if as_json:
        return _print_json(e)
    rows: list[tuple[str, Any]] = [("state", e["state"]), ("why", escape(e["message"]))]
    f = e.get("failure")
    if f and f.get("stderr_tail"):
        rows.append((f"stderr of rank {f['rank']} (last lines)", escape(f["stderr_tail"].rstrip("\n"))))
    if e.get("pending"):
        w = e.get("waiting_for") or {}
        rows += [
            ("reason code", e.get("pending_reason")),
            ("queue position", e.get("queue_position")),
            ("expected start", e.get("expected_start")),
            ("GPUs requested", w.get("gpus_requested")),
            ("GPUs free of its type", w.get("gpus_free_of_type")),
            ("team quota headroom", w.get("team_quota_headroom")),
        ]
    _out().print(_kv_table(f"job {job_id}", rows))


def _my_team(api: ApiClient) -> str:
    me = _run(api.request, "GET", "/v1/me")
    if not me.get("team"):
        _err("error: give a team (this token is not a team member)")
        raise typer.Exit(2)
    return me["team"]


def _team_get(url: str | None, token: str | None, team: str | None, what: str) -> tuple[str, Any]:
    """GET /v1/teams/{team}/{what}, for the given team or the token's own: (team, body)."""
    api = _client(url, token)
    team = team or _my_team(api)
    return team, _run(api.request, "GET", f"/v1/teams/{team}/{what}")


def _quota_table(team: str, quota: dict[str, dict]) -> Table:
    t = Table(
        "gpu type", "guaranteed", "borrow limit", "in use", "borrowed", title=f"team {team}", title_justify="left"
    )
    for gpu_type, q in quota.items():
        t.add_row(gpu_type, str(q["guaranteed"]), str(q.get("borrow_limit", "-")), str(q["in_use"]), str(q["borrowed"]))
    return t


def queue(
    team: YourTeam = None,
    limit: Annotated[int, typer.Option(help="jobs to show")] = 50,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A team's queued jobs in order, with its usage."""
    api = _client(url, token)
    team = team or _my_team(api)
    q = _run(api.request, "GET", f"/v1/teams/{team}/queue", params={"limit": limit})
    if as_json:
        return _print_json(q)
    con = _out()
    con.print(_quota_table(team, q["usage"]))
    con.print("  ".join(f"{k}: {v}" for k, v in q["counts"].items()))
    t = Table("position", "job", "name", "class", "gpus", "pending", "expected start")
    for j in q["jobs"]:
        t.add_row(
            _fmt(j.get("queue_position")),
            j["job_id"],
            _fmt(j.get("name")),
            j["priority_class"],
            str(j["gpus"]),
            _fmt(j.get("pending_reason")),
            _fmt(j.get("expected_start")),
        )
    con.print(t)


quota_app = typer.Typer(help="team quotas: get, set (admin)", no_args_is_help=True)


@quota_app.command("get")
def quota_get(
    team: YourTeam = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A team's quota and usage per GPU type."""
    team, q = _team_get(url, token, team, "quota")
    if as_json:
        return _print_json(q)
    _out().print(_quota_table(team, q))


@quota_app.command("set")
def quota_set(
    team: str,
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="e.g. h100")],
    guaranteed: Annotated[int, typer.Option(help="guaranteed GPUs")],
    reason: Annotated[str, typer.Option(help="recorded in the audit row")],
    borrow_limit: Annotated[int | None, typer.Option("--borrow-limit", help="default: keep the current one")] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Set a team's quota for one GPU type (admin)."""
    body = {"gpu_type": gpu_type, "guaranteed": guaranteed, "reason": reason}
    if borrow_limit is not None:
        body["borrow_limit"] = borrow_limit
    q = _run(_client(url, token).request, "PUT", f"/v1/teams/{team}/quota", json_body=body, write=True)
    if as_json:
        return _print_json(q)
    _out().print(_quota_table(team, q))


classes_app = typer.Typer(help="the priority classes a team may submit in: get, set (admin)", no_args_is_help=True)


def _print_classes(c: dict[str, Any]) -> None:
    restricted = c["priority_classes"] is not None
    _out().print(
        _kv_table(
            f"team {c['team']}",
            [
                ("may submit in", ", ".join(c["allowed"])),
                ("entitlement", "restricted to these" if restricted else "none set: every class"),
            ],
        )
    )


@classes_app.command("get")
def classes_get(
    team: YourTeam = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """The priority classes a team may submit in."""
    _, c = _team_get(url, token, team, "priority-classes")
    if as_json:
        return _print_json(c)
    _print_classes(c)


@classes_app.command("set")
def classes_set(
    team: str,
    reason: Annotated[str, typer.Option(help="recorded in the audit row")],
    allow: Annotated[
        list[str] | None, typer.Option("--allow", help="a class the team may submit in; repeat for several")
    ] = None,
    any_class: Annotated[bool, typer.Option("--any", help="lift the restriction: every class")] = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Set the priority classes a team may submit in (admin): --allow research --allow preemptible, or --any."""
    if any_class == bool(allow):
        raise typer.BadParameter("give --allow CLASS (one or more) or --any, not both")
    body = {"priority_classes": None if any_class else allow, "reason": reason}
    c = _run(_client(url, token).request, "PUT", f"/v1/teams/{team}/priority-classes", json_body=body, write=True)
    if as_json:
        return _print_json(c)
    _print_classes(c)


def nodes(
    node_id: Annotated[str | None, typer.Argument(help="one node in detail")] = None,
    state: Annotated[str | None, typer.Option(help="only nodes in this state")] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Nodes: state, GPUs in use; or one node with its leases."""
    api = _client(url, token)
    if node_id:
        n = _run(api.request, "GET", f"/v1/nodes/{node_id}")
        if as_json:
            return _print_json(n)
        con = _out()
        con.print(
            _kv_table(
                f"node {node_id}",
                [
                    ("block", n["block_id"]),
                    ("type", n["gpu_type"]),
                    ("state", n.get("status") or n["state"]),
                    ("since", n.get("updated_at")),
                    ("reason", n.get("reason")),
                    ("gpus", f"{n['gpus_allocated']}/{n['gpus']} allocated"),
                ],
            )
        )
        t = Table("lease", "job", "team", "rank", "gpus")
        for lease in n["leases"]:
            t.add_row(
                _fmt(lease.get("lease_id")),
                _fmt(lease.get("job_id")),
                _fmt(lease.get("team")),
                _fmt(lease.get("rank")),
                _fmt(lease["gpu_indices"]),
            )
        con.print(t)
        return
    out: list[dict] = []
    cursor = None
    while True:
        page = _run(api.request, "GET", "/v1/nodes", params={"state": state, "cursor": cursor})
        out += page["nodes"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    if as_json:
        return _print_json({"nodes": out})
    t = Table("node", "block", "type", "state (waiting for)", "allocated", "hot spare for", "reason")
    for n in out:
        spare = (n.get("hot_spare_for") or "(another team)") if n.get("hot_spare") else None
        t.add_row(
            n["node_id"],
            n["block_id"],
            n["gpu_type"],
            n.get("status") or n["state"],
            f"{n['gpus_allocated']}/{n['gpus']}",
            _fmt(spare),
            _fmt(n.get("reason")),
        )
    _out().print(t)


def drain(
    node_id: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    evict: Annotated[bool, typer.Option("--evict", help="also stop the node's running jobs")] = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Drain a node: no new placements (admin)."""
    r = _run(
        _client(url, token).request,
        "POST",
        f"/v1/nodes/{node_id}:drain",
        json_body={"reason": reason, "evict": evict},
        write=True,
    )
    if as_json:
        return _print_json(r)
    _out().print(f"{r['node_id']}: {r['previous_state']} -> {r['state']}" + (" (evicting)" if r["evict"] else ""))


def return_node(
    node_id: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Return a draining or cordoned node to service: it goes to burn-in first (admin)."""
    r = _run(
        _client(url, token).request, "POST", f"/v1/nodes/{node_id}:return", json_body={"reason": reason}, write=True
    )
    if as_json:
        return _print_json(r)
    _out().print(f"{r['node_id']}: {r['previous_state']} -> {r['state']}")


credential_app = typer.Typer(help="per-node credentials of the agents: issue, revoke (admin)", no_args_is_help=True)


@credential_app.command("issue")
def credential_issue(
    node_id: str,
    reason: Annotated[str, typer.Option(help="why (audited)")] = "provisioning",
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Issue (or rotate) a node's credential; it is printed once, with the node's log key, as
    the two settings the node's agent needs (each may instead be a 0600 file named by
    GPUFLEET_AGENT_CREDENTIALS_FILE / GPUFLEET_AGENT_LOG_KEYS_FILE)."""
    r = _run(
        _client(url, token).request,
        "POST",
        f"/v1/nodes/{node_id}:issue-credential",
        json_body={"reason": reason},
        write=True,
    )
    if as_json:
        return _print_json(r)
    if r.get("credential") is None:
        _out().print(f"{r['node_id']}: already issued by this request; issue again to rotate")
        return
    node = r["node_id"]
    print(f"GPUFLEET_AGENT_CREDENTIALS='{json.dumps({node: r['credential']})}'")
    print(f"GPUFLEET_AGENT_LOG_KEYS='{json.dumps({node: r['log_key']})}'")


@credential_app.command("revoke")
def credential_revoke(
    node_id: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Revoke a node's credential: its agent is refused until a new one is issued."""
    r = _run(
        _client(url, token).request,
        "POST",
        f"/v1/nodes/{node_id}:revoke-credential",
        json_body={"reason": reason},
        write=True,
    )
    if as_json:
        return _print_json(r)
    _out().print(f"{r['node_id']}: " + ("revoked" if r["revoked"] else "had no live credential"))


def register(app: typer.Typer) -> None:
    """Add the user commands to the top-level `gpufleet` app."""
    app.command("submit")(submit)
    app.command("status")(status)
    app.command("list")(list_jobs)
    app.command("events")(events)
    app.command("logs")(logs)
    app.command("cancel")(cancel)
    app.command("extend")(extend)
    app.command("explain")(explain)
    app.command("queue")(queue)
    app.add_typer(quota_app, name="quota")
    app.add_typer(classes_app, name="classes")
    app.command("nodes")(nodes)
    app.command("drain")(drain)
    app.command("return-node")(return_node)
    app.add_typer(credential_app, name="node-credential")

"""``omni``: the researcher's command line over the REST API (docs/cli.md, docs/api.md).

It submits a job from a TOML file, lists and explains jobs, follows their logs and cancels them,
and shows teams' quotas (docs/teams.md), with an API token (``Authorization: Token``). Like the rest of ``trainer_agent`` it imports no
Django: it runs on laptops and login nodes and speaks only the documented API (stdlib HTTP).
Exit codes: 0 ok, 1 the server or the network failed (or ``--wait`` saw the job fail), 2 the
user's input was wrong (usage, a bad job file, a 400 or an unknown job).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import click

TIMEOUT_S = 30.0
LOG_POLL_S = 1.0
WAIT_POLL_S = 2.0
TERMINAL_STATES = ("completed", "failed", "cancelled")
WAITING_STATES = ("pending", "preempted", "recovering")
STATES = ("pending", "running", "checkpointing", "preempted", "resizing", "recovering", *TERMINAL_STATES)
CLASS_ORDER = ("critical", "regular", "best_effort")  # the planner's order of priority classes
NOT_CONSIDERED = "The planner has not considered this job yet."

# The job file's keys: POST /api/jobs/'s fields (jobs.api.serializers.JobSubmitSerializer), with
# the TOML type each must have. Checked here so a mistake names its line, not only its field.
SPEC_FIELDS: dict[str, str] = {
    "name": "string", "priority": "string", "workdir": "string", "integration": "string", "team": "string",
    "tp": "integer", "pp": "integer", "dp": "integer", "dp_min": "integer", "dp_max": "integer",
    "global_batch": "integer", "micro_batch": "integer", "total_steps": "integer", "min_run_s": "integer",
    "checkpoint_every_steps": "integer", "max_restarts": "integer", "keep_checkpoints": "integer",
    "step_s": "number", "comm_fraction": "number", "checkpoint_save_s": "number",
    "checkpoint_load_s": "number", "grace_s": "number",
    "entrypoint": "list of strings", "env": "table of strings",
}


# -- errors: one line on stderr, and the exit code that says whose fault it was -----------------

class Failure(click.ClickException):
    """A refusal or failure shown as ``omni: error: ...`` lines, with its exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        for line in self.message.splitlines() or [""]:
            click.echo(f"omni: error: {line}", err=True)


class ApiError(Failure):
    """The API answered with an error status: a 400 or 404 is the user's input (exit 2)."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        super().__init__(api_error_words(status, body), exit_code=2 if status in (400, 404) else 1)


def api_error_words(status: int, body: Any) -> str:
    """A 400's fields as ``field: message`` lines, any other error's ``detail`` in one line."""
    if isinstance(body, dict) and status == 400:
        lines = []
        for field, messages in body.items():
            for message in messages if isinstance(messages, list) else [messages]:
                lines.append(f"{field}: {message if isinstance(message, str) else json.dumps(message)}")
        return "\n".join(lines) or "the server refused the request (400)"
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return {401: "not signed in: the token is unknown or revoked (omni login)", 404: "not found"}.get(
        status, f"the server answered {status}")


# -- credentials --------------------------------------------------------------------------------

def config_path() -> Path:
    """``$XDG_CONFIG_HOME/omni/config.json``, else ``~/.config/omni/config.json``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "omni" / "config.json"


def save_credentials(url: str, token: str) -> Path:
    """Write ``{url, token}`` readable by the user only (file 0600, directory 0700)."""
    path = config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        json.dump({"url": url, "token": token}, out)
        out.write("\n")
    os.replace(path.with_suffix(".tmp"), path)
    return path


def stored_credentials() -> dict[str, Any]:
    """What ``omni login`` stored (``{url, token}``), or ``{}`` when nothing is."""
    path = config_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot read {path}: {exc}", 2) from None


def load_credentials() -> tuple[str, str]:
    """The server URL and token: ``OMNI_URL``/``OMNI_TOKEN`` first, then the config file."""
    stored = stored_credentials()
    url = os.environ.get("OMNI_URL") or stored.get("url") or ""
    token = os.environ.get("OMNI_TOKEN") or stored.get("token") or ""
    if not url or not token:
        raise Failure("not logged in: run `omni login --url URL`, or set OMNI_URL and OMNI_TOKEN", 2)
    return url.rstrip("/"), token


# -- the API ------------------------------------------------------------------------------------

class Api:
    """The REST API with one token; every call returns the decoded JSON or raises ApiError."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self.token = token

    def request(self, method: str, path: str, params: Sequence[tuple[str, Any]] = (), body: Any = None) -> Any:
        query = urllib.parse.urlencode([(k, v) for k, v in params if v is not None])
        target = path if path.startswith("http") else f"{self.url}{path}"
        if query:
            target += ("&" if "?" in target else "?") + query
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(target, data=data, method=method, headers={
            "Authorization": f"Token {self.token}", "Accept": "application/json",
            **({"Content-Type": "application/json"} if data is not None else {}),
        })
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw) if raw else None
            except ValueError:
                payload = None
            raise ApiError(exc.code, payload) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Failure(f"cannot reach {self.url}: {reason}") from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise Failure(f"{self.url} did not answer JSON: is it an Omni server?") from None

    def get(self, path: str, params: Sequence[tuple[str, Any]] = ()) -> Any:
        return self.request("GET", path, params)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body=body)

    def pages(self, path: str, params: Sequence[tuple[str, Any]] = (), limit: int | None = None) -> Iterator[dict]:
        """The rows of a paginated list (``limit``/``offset``, ``next`` links), up to ``limit``."""
        page = self.get(path, params)
        seen = 0
        while True:
            for row in page["results"]:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield row
            if not page.get("next"):
                return
            page = self.get(page["next"])

    def job(self, ref: str) -> dict:
        """A job by name, else by id; an unknown one is a 404 (exit 2)."""
        for row in self.pages("/api/jobs/", [("q", ref)]):
            if row["name"] == ref:
                return row
        if ref.isdigit():
            try:
                return self.get(f"/api/jobs/{ref}/")
            except ApiError as exc:
                if exc.status != 404:
                    raise
        raise ApiError(404, {"detail": f"no job {ref!r} (or not one you may see)"})

    def page_url(self, job: dict) -> str:
        return f"{self.url}/jobs/{job['id']}/"


class Ctx:
    """What every command receives: ``--json`` and the API, made on first use."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self._api: Api | None = None

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(*load_credentials())
        return self._api


# -- the job file -------------------------------------------------------------------------------

def key_line(text: str, key: str) -> int | None:
    """The line where ``key`` is set (``key = ...`` or a ``[key]`` table), for error messages."""
    pattern = re.compile(rf"^\s*(?:{re.escape(key)}\s*=|\[\s*{re.escape(key)}\s*\])")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return None


def _type_ok(kind: str, value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int)
    if kind == "number":
        return isinstance(value, int | float)
    if kind == "list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def load_spec(path: Path) -> dict[str, Any]:
    """The job file as the body of POST /api/jobs/, with relative script and workdir paths made
    absolute from the file's directory (the agents need absolute paths on shared storage).
    A bad file is one line naming the file, the line and the field (exit 2)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise Failure(f"cannot read {path}: {exc}", 2) from None
    try:
        spec = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = re.sub(r"\s*\(at (?:line \d+, column \d+|end of document)\)$", "", str(exc))
        line = getattr(exc, "lineno", None)
        where = f"line {line}, column {exc.colno}" if line else _position(str(exc))
        raise Failure(f"{path}: {where}: {message}", 2) from None

    def refuse(key: str, words: str) -> NoReturn:
        line = key_line(text, key)
        raise Failure(f"{path}: {f'line {line}: ' if line else ''}{key}: {words}", 2)

    for key, value in spec.items():
        kind = SPEC_FIELDS.get(key)
        if kind is None:
            close = difflib.get_close_matches(key, SPEC_FIELDS, n=1)
            refuse(key, f"unknown field{f'; did you mean {close[0]!r}?' if close else ''} (docs/cli.md lists them)")
        if not _type_ok(kind, value):
            refuse(key, f"expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {_toml_type(value)}")
    base = Path(os.path.abspath(path)).parent  # not resolve(): a shared mount keeps its name
    entrypoint = spec.get("entrypoint")
    if entrypoint and entrypoint[0].endswith(".py") and not os.path.isabs(entrypoint[0]):
        script = os.path.normpath(base / entrypoint[0])
        if not os.path.isfile(script):
            # Caught here, not as a rank's "can't open file" once the job has waited for GPUs.
            # An absolute path is left to the agents: it may be on storage only they mount.
            refuse("entrypoint", f"{entrypoint[0]}: no such file ({script}; a relative script is "
                   "found from the job file's directory)")
        spec["entrypoint"] = [script, *entrypoint[1:]]
    if spec.get("workdir") and not os.path.isabs(spec["workdir"]):
        spec["workdir"] = os.path.normpath(base / spec["workdir"])
    return spec


def _position(message: str) -> str:
    found = re.search(r"at (line \d+, column \d+|end of document)", message)
    return found.group(1) if found else "syntax"


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string ({json.dumps(value)[:60]})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, list):
        return "a list with a non-string item" if all(not isinstance(v, list | dict) for v in value) else "a nested list"
    if isinstance(value, dict):
        return "a table with a non-string value"
    return type(value).__name__


# -- output -------------------------------------------------------------------------------------

def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str) -> None:
    """Plain aligned columns, the last one unpadded."""
    if not rows:
        click.echo(empty)
        return
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)), row[-1]]).rstrip())


def when(value: str | None) -> str:
    """An API time in the local timezone, to the second."""
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return value


def facts(outcome: Any) -> str:
    """An audit row's outcome as ``key=value`` pairs (JSON for a nested value), empty ones left
    out: ``ack_ms=647.4 attempts=1 kind=start``, not a Python dict's repr."""
    if not isinstance(outcome, dict):
        return "" if outcome is None else str(outcome)
    return " ".join(f"{key}={value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}"
                    for key, value in outcome.items() if value is not None and value != "")


def steps(job: dict) -> str:
    if "total_steps" not in job:
        return "-"
    return f"{job.get('committed_steps', 0)}/{job['total_steps']}"


def failure_words(failure: dict) -> str:
    who = f"rank {failure['rank']}" if failure.get("rank") is not None else "torchrun"
    how = f"signal {failure['signal']}" if failure.get("signal") else f"code {failure.get('code')}"
    return f"{who} on {failure.get('node', '?')} exited with {how}"


def complete_job(click_ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion of JOB: the names of the jobs the user sees (nothing when offline)."""
    try:
        api = Api(*load_credentials())
        return [row["name"] for row in api.pages("/api/jobs/", [("q", incomplete or None), ("limit", 50)], 50)
                if row["name"].startswith(incomplete)]
    except (click.ClickException, KeyError, TypeError):
        return []


job_argument = click.argument("job", shell_complete=complete_job)


# -- commands -----------------------------------------------------------------------------------

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of a table.")


def command(*args: Any, **kwargs: Any):
    """A subcommand with ``--json`` that receives the ``Ctx``."""
    def wrap(fn):
        @functools.wraps(fn)  # keeps fn's click options (``__click_params__``)
        def run(*a: Any, as_json: bool, **kw: Any) -> Any:
            return fn(Ctx(as_json), *a, **kw)
        return main.command(*args, **kwargs)(json_option(run))
    return wrap


class OmniGroup(click.Group):
    """click's group with every error as ``omni: error:`` lines on stderr, a usage error in one
    line naming the help to read (click's own prints the usage block first)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any) -> NoReturn:
        extra.pop("standalone_mode", None)
        try:
            code = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `omni`: the help, as a usage error
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "omni"
            click.echo(f"omni: error: {exc.format_message()} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("omni: error: interrupted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OmniGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="omni", prog_name="omni")
def main() -> None:
    """Submit and follow jobs on an Omni GPU cluster (docs/cli.md).

    Credentials come from OMNI_URL/OMNI_TOKEN, else from `omni login`.
    """


@command()
@click.option("--url", required=True, help="The control plane, e.g. https://omni.example")
@click.option("--token-file", type=click.File("r"), help="Read the API token from this file (- for stdin).")
def login(ctx: Ctx, url: str, token_file: Any) -> None:
    """Check an API token and store it for the next commands."""
    if token_file is not None:
        token = token_file.read().strip()
    else:
        token = click.prompt("API token (manage.py issue_api_token NAME)", hide_input=True, err=True).strip()
    if not token:
        raise Failure("the token is empty", 2)
    if not re.match(r"^https?://", url):
        raise Failure(f"--url: {url!r} is not an http:// or https:// URL", 2)
    api = Api(url, token)
    api.get("/api/jobs/", [("limit", 1)])
    path = save_credentials(api.url, token)
    if ctx.as_json:
        emit_json({"url": api.url, "config": str(path)})
    else:
        click.echo(f"Logged in to {api.url}; credentials saved in {path}")


@command()
@click.option("--keep-token", is_flag=True, help="Only forget the stored credentials; the token stays valid.")
def logout(ctx: Ctx, keep_token: bool) -> None:
    """Revoke the API token on the server and forget the stored credentials.

    The token is the one every command uses (OMNI_TOKEN first, else the stored one); a token the
    server already refuses (revoked, unknown) is forgotten all the same."""
    path, stored = config_path(), stored_credentials()
    said: list[str] = []
    revoked = False
    token = os.environ.get("OMNI_TOKEN") or stored.get("token")
    if keep_token:
        if not stored:
            raise Failure(f"not logged in: there are no stored credentials ({path})", 2)
    else:
        api = ctx.api  # the same token: load_credentials reads OMNI_TOKEN, then the file
        try:
            api.request("DELETE", "/api/token/")
            revoked = True
            # Its prefix as the server shows it (jobs.models.tokens: the 6 characters after "omni_").
            said.append(f"Revoked the API token {token[5:11]}… on {api.url}")
        except ApiError as exc:
            if exc.status != 401:
                raise
            said.append(f"{api.url} already refuses the token ({exc}); nothing to revoke")
    # --keep-token forgets what is stored; a logout forgets it when it holds the token revoked.
    forgot = bool(stored) and (keep_token or stored.get("token") == token)
    if forgot:
        path.unlink()
        said.append(f"removed {path}")
    elif stored:
        said.append(f"{path} holds another token, kept")
    if os.environ.get("OMNI_TOKEN"):
        said.append("OMNI_TOKEN is still set in this shell")
    if ctx.as_json:
        emit_json({"revoked": revoked, "forgot": forgot, "config": str(path)})
    else:
        click.echo("; ".join(said) + ".")


@command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="Follow the job until it runs or ends.")
def submit(ctx: Ctx, job_file: Path, wait: bool) -> None:
    """Submit the job described by a TOML file (its keys are POST /api/jobs/'s fields)."""
    spec = load_spec(job_file)
    api = ctx.api
    job = api.post("/api/jobs/", spec)
    if ctx.as_json and not wait:
        emit_json(job)
        return
    if not ctx.as_json:
        click.echo(f"Submitted job {job['id']} {job['name']}: {api.page_url(job)}")
    if wait:
        job = wait_for_start(ctx, job)
        if ctx.as_json:
            emit_json(job)
        if job["state"] in ("failed", "cancelled"):
            raise Failure(f"{job['name']} {job['state']}" + (
                f": {failure_words(job['failure'])}" if job.get("failure") else ""))


def wait_for_start(ctx: Ctx, job: dict) -> dict:
    """Poll the job, one progress line per change, until it runs or ends."""
    last = None
    while True:
        line = f"{job['name']}: {job['state']}, step {steps(job)}"
        if job["state"] in WAITING_STATES and job.get("pending_reason"):
            line += f" ({job['pending_reason']})"
        if line != last:
            click.echo(line, err=ctx.as_json)
            last = line
        if job["state"] not in WAITING_STATES:
            return job
        time.sleep(WAIT_POLL_S)
        job = ctx.api.get(f"/api/jobs/{job['id']}/")


@command()
@click.option("--mine", is_flag=True, help="Only my jobs.")
@click.option("--state", type=click.Choice(STATES), help="Only jobs in this state.")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True, help="At most this many, newest first.")
def jobs(ctx: Ctx, mine: bool, state: str | None, limit: int) -> None:
    """List jobs, newest first."""
    params = [("mine", "true" if mine else None), ("state", state), ("limit", min(limit, 200))]
    rows = list(ctx.api.pages("/api/jobs/", params, limit))
    if ctx.as_json:
        emit_json(rows)
        return
    table(["ID", "NAME", "OWNER", "PRIORITY", "STATE", "GPUS", "STEPS", "SUBMITTED"],
          [[j["id"], j["name"], j.get("owner", ""), j["priority"], j["state"], j.get("gpus", 0), steps(j),
            when(j.get("submitted_at"))] for j in rows], "No jobs.")


@command()
@job_argument
def status(ctx: Ctx, job: str) -> None:
    """Show one job (JOB: its name or id)."""
    row = ctx.api.job(job)
    if ctx.as_json:
        emit_json(row)
        return
    fields = [("job", f"{row['id']} {row['name']}"), ("owner", row.get("owner")), ("priority", row["priority"]),
              ("state", row["state"]), ("gpus", row.get("gpus"))]
    if row.get("visibility") == "full":
        held = ", ".join(sorted({a["node"] for a in row.get("allocations", [])}))
        # A finished job holds nothing: say where its last run was instead.
        nodes = ("ran on", last_nodes(ctx.api, row["name"]) or "-") if not held and row.get("finished_at") else \
            ("nodes", held or "-")
        fields += [
            ("layout", f"tp {row['tp']} x pp {row['pp']} x dp {row['dp']} (dp {row['dp_min']}..{row['dp_max']})"),
            ("batch", f"global {row['global_batch']}, micro {row['micro_batch']}, accumulation {row['accum_steps']}"),
            ("steps", f"{steps(row)}, as its script reported (its checkpoints are its own, unseen by Omni)"
             if row.get("integration") == "signal" else
             f"{steps(row)}, last checkpoint at step {row.get('last_checkpoint_step') or 0}"),
            ("workload", " ".join(row.get("entrypoint") or [])),
            ("workdir", row.get("workdir") or "(the job's run dir)"),
            ("integration", row.get("integration")),
            ("restarts", f"{row.get('restarts', 0)} of {row.get('max_restarts', 0)}"),
            ("preemptions", row.get("preemptions")),
            ("submitted", when(row.get("submitted_at"))), ("started", when(row.get("started_at"))),
            ("finished", when(row.get("finished_at"))),
            nodes,
        ]
        if row.get("failure"):
            fields.append(("failure", failure_words(row["failure"])))
    fields.append(("page", ctx.api.page_url(row)))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {'-' if value is None else value}")


# The audit rows that end a job's last run, naming the nodes they released (jobs.views.ENDING_KINDS).
ENDING_KINDS = ("complete", "fail", "cancel")


def last_nodes(api: Api, name: str) -> str | None:
    """Where a finished job last ran: the nodes its ending row released (newest rows first)."""
    for event in api.pages("/api/events/", [("job", name), ("limit", 20)], 20):
        if event["kind"] in ENDING_KINDS and event.get("nodes_before"):
            return ", ".join(sorted(event["nodes_before"]))
    return None


def why_words(api: Api, job: dict) -> str:
    """Why the job is where it is, in the job page's words (jobs/waiting.py)."""
    state, name = job["state"], job["name"]
    if state in WAITING_STATES:
        lead, tail = {"pending": ("Waiting since", ""),
                      "preempted": ("Preempted; waiting since", f" to resume from step {job.get('last_checkpoint_step')}"),
                      "recovering": ("Recovering since", f" after a fault, to restart from step "
                                                        f"{job.get('last_checkpoint_step')}")}[state]
        # A job the planner has not looked at yet has waited since it was submitted.
        since = job.get("pending_since") or (job.get("submitted_at") if state == "pending" else None)
        lead = f"{lead} {when(since)}" if since else lead.replace(" since", "")
        reason = job.get("pending_reason") or last_hold_reason(api, name) or NOT_CONSIDERED
        return f"{name}: {lead}{tail}. {reason}"
    if state == "failed":
        failure = job.get("failure") or {}
        words = f"{name} failed" + (f": {failure_words(failure)}" if failure else "")
        tail = [line for line in (failure.get("tail") or "").splitlines() if line.strip()]
        return "\n".join([words, *(f"  {line}" for line in tail[-10:])])
    if state in ("completed", "cancelled"):
        return f"{name} {state} at {when(job.get('finished_at'))}."
    return f"{name} is {state} on {job.get('gpus', 0)} GPUs, step {steps(job)}."


def last_hold_reason(api: Api, name: str) -> str:
    try:
        rows = api.get("/api/events/", [("job", name), ("kind", "hold"), ("limit", 1)])["results"]
    except ApiError:
        return ""  # a researcher who may not read the audit rows
    reason = rows[0].get("reason") if rows else None
    return str(reason.get("text", "")) if isinstance(reason, dict) else ""


@command()
@job_argument
def why(ctx: Ctx, job: str) -> None:
    """Say why a job waits, or how it failed."""
    row = ctx.api.job(job)
    words = why_words(ctx.api, row)
    if ctx.as_json:
        emit_json({"id": row["id"], "name": row["name"], "state": row["state"], "why": words,
                   "pending_reason": row.get("pending_reason"), "failure": row.get("failure")})
    else:
        click.echo(words)


@command()
@job_argument
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True, help="The latest this many rows.")
def events(ctx: Ctx, job: str, limit: int) -> None:
    """The audit log rows of a job, oldest first."""
    name = ctx.api.job(job)["name"]
    rows = list(ctx.api.pages("/api/events/", [("job", name), ("limit", min(limit, 200))], limit))[::-1]
    if ctx.as_json:
        emit_json(rows)
        return
    table(["AT", "KIND", "ACTOR", "OUTCOME", "REASON"],
          [[when(r["at"]), r["kind"], r["actor"], facts(r.get("outcome")),
            (r.get("reason") or {}).get("text", "") if isinstance(r.get("reason"), dict) else ""] for r in rows],
          f"No audit rows for {name}.")


@command()
@job_argument
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--rank", "ranks", type=click.IntRange(0), multiple=True, help="Only this global rank (repeatable).")
@click.option("--stream", type=click.Choice(["out", "err"]), help="Only stdout (out) or stderr (err).")
def logs(ctx: Ctx, job: str, follow: bool, ranks: tuple[int, ...], stream: str | None) -> None:
    """Print a job's log lines (with --json: one JSON object a line)."""
    api = ctx.api
    row = api.job(job)
    after = 0
    while True:
        params: list[tuple[str, Any]] = [("after", after or None), ("stream", stream), ("limit", 1000)]
        params += [("rank", r) for r in ranks]
        page = api.get(f"/api/jobs/{row['id']}/logs/", params)
        for line in page["lines"]:
            click.echo(json.dumps(line, sort_keys=True) if ctx.as_json else f"[rank {line['rank']}{' err' if line['stream'] == 'err' else ''}] {line['text']}")
            after = line["id"]
        if page.get("next_after"):
            continue
        if not follow:
            return
        if not page["lines"]:
            if row["state"] in TERMINAL_STATES:
                return
            time.sleep(LOG_POLL_S)
            row = api.get(f"/api/jobs/{row['id']}/")


@command()
@job_argument
def cancel(ctx: Ctx, job: str) -> None:
    """Cancel a job: its ranks stop and its GPUs are freed."""
    row = ctx.api.job(job)
    done = ctx.api.post(f"/api/jobs/{row['id']}/cancel/")
    if ctx.as_json:
        emit_json(done)
    else:
        click.echo(f"Cancelled job {done['id']} {done['name']} ({done['state']}).")


@command()
def queue(ctx: Ctx) -> None:
    """Waiting jobs by class, then oldest first (the planner's own order also weighs ageing, teams and
    a regular job's length: docs/planner.md)."""
    rows = [row for state in WAITING_STATES for row in ctx.api.pages("/api/jobs/", [("state", state), ("limit", 200)])]
    # Ids follow submission order, and a summary (someone else's job) carries no times.
    rows.sort(key=lambda r: (CLASS_ORDER.index(r["priority"]) if r["priority"] in CLASS_ORDER else len(CLASS_ORDER),
                             r["id"]))
    if ctx.as_json:
        emit_json(rows)
        return
    table(["ID", "NAME", "OWNER", "PRIORITY", "STATE", "SUBMITTED", "WHY"],
          [[r["id"], r["name"], r.get("owner", ""), r["priority"], r["state"], when(r.get("submitted_at")),
            r.get("pending_reason") or ""] for r in rows], "No job is waiting.")


@command()
def nodes(ctx: Ctx) -> None:
    """The cluster's nodes."""
    rows = list(ctx.api.pages("/api/nodes/", [("limit", 200)]))
    if ctx.as_json:
        emit_json(rows)
        return
    table(["NAME", "RACK", "SWITCH", "STATE", "GPUS", "MODEL", "HEARTBEAT"],
          [[n["name"], n["rack"], n["switch"], n["state"], f"{n.get('gpus_allocated', 0)}/{n['gpu_count']}",
            n["gpu_model"], when(n.get("last_heartbeat_at"))] for n in rows], "No nodes.")


# -- teams (docs/teams.md) ------------------------------------------------------------------------

def limit_words(limit: int | None) -> str:
    return "no limit" if limit is None else str(limit)


def borrow_room_words(team: dict) -> str:
    """What the team may still take: within its quota, and borrowed beyond it."""
    held, quota, limit = team["gpus_held"], team["quota_gpus"], team.get("borrow_limit_gpus")
    within = max(0, quota - held)
    if limit is None:
        beyond = "any idle GPU beyond its quota"
    else:
        left = max(0, limit - max(0, held - quota))
        beyond = f"{left} more beyond its quota" if left else "nothing more beyond its quota (at its borrowing limit)"
    return f"{within} GPUs within its quota, then {beyond}"


def find_team(api: Api, ref: str | None) -> dict:
    """A team by name (or id); none named: the caller's default team. Unknown: a 404 (exit 2)."""
    if ref is None:
        mine = list(api.pages("/api/teams/", [("mine", "true"), ("limit", 200)]))
        chosen = next((t for t in mine if t.get("default")), mine[0] if len(mine) == 1 else None)
        if chosen is None:
            raise Failure("you are in no team" + (" with a default" if mine else "") +
                          ": name one (omni teams lists them)", 2)
        return api.get(f"/api/teams/{chosen['id']}/")
    for row in api.pages("/api/teams/", [("limit", 200)]):
        if row["name"] == ref or str(row["id"]) == ref:
            return api.get(f"/api/teams/{row['id']}/")
    raise ApiError(404, {"detail": f"no team {ref!r} (omni teams lists them)"})


@command()
def teams(ctx: Ctx) -> None:
    """Every team: GPUs in use against its quota, borrowing limit, weight."""
    rows = list(ctx.api.pages("/api/teams/", [("limit", 200)]))
    if ctx.as_json:
        emit_json(rows)
        return
    table(["NAME", "PARENT", "GPUS/QUOTA", "BORROW LIMIT", "WEIGHT", "MEMBERS"],
          [[t["name"], t.get("parent") or "-", f"{t['gpus_held']}/{t['quota_gpus']}", limit_words(t.get("borrow_limit_gpus")),
            f"{t['weight']:g}", t.get("members_count", "")] for t in rows], "No teams.")


@command()
@click.argument("team", required=False)
def quota(ctx: Ctx, team: str | None) -> None:
    """A team's GPUs against its quota, what it may still borrow, its running and waiting jobs
    (TEAM: a name or id; default: your default team)."""
    row = find_team(ctx.api, team)
    if ctx.as_json:
        emit_json(row)
        return
    running = [j for j in row["jobs"] if j["state"] not in WAITING_STATES]
    waiting = [j for j in row["jobs"] if j["state"] in WAITING_STATES]
    fields = [
        ("team", row["name"] + (f" (in {row['parent']})" if row.get("parent") else "")),
        ("quota", f"{row['quota_gpus']} GPUs guaranteed, borrowing limit {limit_words(row.get('borrow_limit_gpus'))}, "
                  f"weight {row['weight']:g}"),
        ("in use", row["words"]),
        ("may take", borrow_room_words(row)),
        ("running", f"{len(running)} jobs on {sum(j.get('gpus', 0) for j in running)} GPUs"),
        ("waiting", f"{len(waiting)} jobs"),
        ("page", f"{ctx.api.url}/teams/{row['id']}/"),
    ]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {value}")
    if row["jobs"]:
        click.echo("")
        table(["ID", "NAME", "OWNER", "PRIORITY", "STATE", "GPUS"],
              [[j["id"], j["name"], j.get("owner", ""), j["priority"], j["state"], j.get("gpus", 0)]
               for j in running + waiting], "")


if __name__ == "__main__":
    main(prog_name="omni")

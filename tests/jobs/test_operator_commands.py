"""The operators' commands: ``add_node``, ``add_user``, ``issue_api_token`` and
``issue_agent_token`` do their work through the audited actions, and every bad argument or
refusal exits 2 with exactly one line on stderr (``add_node: error: ...``), run as the real
``python manage.py`` an operator types."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client

from jobs.models import ApiToken, ElasticEvent, Node, hash_api_token
from jobs.roles import OPERATOR, RESEARCHER, role_names

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, *args: str, **options) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(name, *args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def _manage(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``python manage.py ...`` as an operator runs it, against this test's database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["OMNI_VAR_DIR"] = str(tmp_path / "var")
    env.setdefault("SECRET_KEY", "omni-operator-command-tests")
    if connection.vendor == "postgresql":
        db = connection.settings_dict
        user = quote(db.get("USER") or "")
        auth = f"{user}:{quote(db['PASSWORD'])}@" if db.get("PASSWORD") else (f"{user}@" if user else "")
        env["DATABASE_URL"] = f"postgres://{auth}{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}/{db['NAME']}"
    else:
        env.pop("DATABASE_URL", None)
    return subprocess.run([sys.executable, "manage.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def role_groups(transactional_db):
    """The role groups, which a transactional test's table flush empties with the rest."""
    from django.contrib.auth.models import Group

    from jobs.roles import ROLES

    for name in ROLES:
        Group.objects.get_or_create(name=name)


def _assert_one_line_refusal(result: subprocess.CompletedProcess, command: str, says: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{command}: error: "), lines
    assert says in lines[0], lines
    assert result.stdout == ""


# -- success paths -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_add_node_registers_an_audited_healthy_node_and_says_how_to_issue_its_token():
    out, _ = _run("add_node", "r7s0n0", "--rack", "r7", "--switch", "r7s0", "--gpus", "4", "--gpu-model", "L40S")
    node = Node.objects.get(name="r7s0n0")
    assert (node.rack, node.switch, node.gpu_count, node.gpu_model, node.state) == ("r7", "r7s0", 4, "L40S", "healthy")
    assert "Registered node r7s0n0: 4x L40S in rack r7, switch r7s0 (healthy)." in out
    assert "manage.py issue_agent_token r7s0n0" in out
    event = ElasticEvent.objects.get()
    assert (event.kind, event.actor, event.actor_user, event.nodes_after) == (
        "node_registered", "system", None, ["r7s0n0"])


@pytest.mark.django_db
def test_add_node_defaults_the_gpu_model():
    _run("add_node", "r7s0n1", "--rack", "r7", "--switch", "r7s0", "--gpus", "8")
    assert Node.objects.get().gpu_model == "H100-80GB"


@pytest.mark.django_db
def test_add_user_without_a_password_has_none_usable_and_is_told_what_to_do():
    out, _ = _run("add_user", "nora", "--role", RESEARCHER)
    user = User.objects.get(username="nora")
    assert role_names(user) == {RESEARCHER} and not user.is_staff
    assert not user.has_usable_password()
    assert "No password yet" in out and "manage.py issue_api_token nora" in out
    event = ElasticEvent.objects.get()
    assert (event.kind, event.actor) == ("user_added", "system")
    assert event.reason["inputs"] == {"user": "nora", "role": RESEARCHER, "password": "none"}


@pytest.mark.django_db
def test_add_user_takes_the_password_from_a_file_without_its_newline(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("correct horse battery staple\n")
    out, _ = _run("add_user", "oscar", "--role", OPERATOR, "--password-file", str(secret))
    user = User.objects.get(username="oscar")
    assert user.check_password("correct horse battery staple")
    assert role_names(user) == {OPERATOR} and user.is_staff  # the admin is an operator's browser
    assert "No password" not in out
    event = ElasticEvent.objects.get()
    assert event.reason["inputs"]["password"] == "set"
    assert "correct horse" not in str(event.reason)


@pytest.mark.django_db
def test_issue_api_token_prints_the_token_alone_and_stores_its_hash(researcher):
    out, err = _run("issue_api_token", "rita", "--label", "laptop")
    token = out.strip()
    assert out == token + "\n" and token.startswith("omni_")
    row = ApiToken.objects.get()
    assert (row.user, row.label, row.digest) == (researcher, "laptop", hash_api_token(token))
    assert "shown this once" in err and token not in err
    event = ElasticEvent.objects.get()
    assert (event.kind, event.actor) == ("token_issued", "system") and token not in str(event.reason)
    assert Client(HTTP_AUTHORIZATION=f"Token {token}").get("/api/jobs/").status_code == 200


@pytest.mark.django_db
def test_issue_agent_token_prints_a_token_that_matches_the_node(make_nodes):
    node = make_nodes()[0]
    out, _ = _run("issue_agent_token", node.name)
    node.refresh_from_db()
    assert node.token_matches(out.strip())


# -- refusals from the action or the command (call_command: CommandError with status 2) ---------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["issue_api_token", "nobody"], "no user named 'nobody'"),
        (["issue_agent_token", "nowhere"], "no node named 'nowhere'"),
        (["add_node", "r0s0n0", "--rack", "r0", "--switch", "r0s0", "--gpus", "8"], "name: Node with this Name already exists."),
        (["add_node", "r8s0n0", "--rack", "r8", "--switch", "r8s0", "--gpus", "0"], "--gpus: a node has at least one GPU"),
        (["add_user", "rita", "--role", "researcher"], "NAME: a user named 'rita' already exists"),
        (["add_user", "bad name!", "--role", "researcher"], "NAME: Enter a valid username."),
        (["add_user", "pat", "--role", "researcher", "--password-file", "/no/such/file"],
         "--password-file: cannot read /no/such/file: No such file or directory"),
    ],
)
def test_a_refusal_is_a_command_error_with_status_2_and_writes_nothing(researcher, make_nodes, argv, says):
    make_nodes()
    rows = (ElasticEvent.objects.count(), Node.objects.count(), User.objects.count(), ApiToken.objects.count())
    with pytest.raises(CommandError) as refused:
        _run(*argv)
    assert refused.value.returncode == 2
    assert says in str(refused.value)
    assert (ElasticEvent.objects.count(), Node.objects.count(), User.objects.count(), ApiToken.objects.count()) == rows


@pytest.mark.django_db
def test_a_weak_password_is_refused_by_the_password_validators(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("123\n")
    with pytest.raises(CommandError, match="--password-file: This password is too short"):
        _run("add_user", "quinn", "--role", "auditor", "--password-file", str(secret))
    assert not User.objects.filter(username="quinn").exists()


# -- as an operator types them: one line on stderr, status 2 ----------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["add_node", "r0s0n0", "--switch", "r0s0", "--gpus", "8"], "the following arguments are required: --rack"),
        (["add_node", "r0s0n0", "--rack", "r0", "--switch", "r0s0", "--gpus", "eight"], "argument --gpus: invalid int value: 'eight'"),
        (["add_node", "r0s0n0", "--rack", "r0", "--switch", "r0s0", "--gpus", "8", "--colour", "red"], "unrecognized arguments: --colour red"),
        (["add_user", "pat", "--role", "boss"], "argument --role: invalid choice: 'boss'"),
        (["add_user"], "the following arguments are required: name, --role"),
        (["issue_api_token"], "the following arguments are required: name"),
        (["issue_agent_token"], "the following arguments are required: node"),
    ],
)
def test_a_bad_argument_exits_2_with_one_line(tmp_path, argv, says):
    _assert_one_line_refusal(_manage(*argv, tmp_path=tmp_path), argv[0], says)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["issue_api_token", "nobody"], "no user named 'nobody'"),
        (["issue_agent_token", "nowhere"], "no node named 'nowhere'"),
        (["add_node", "r0s0n0", "--rack", "r0", "--switch", "r0s0", "--gpus", "8"], "name: Node with this Name already exists."),
        (["add_user", "pat", "--role", "researcher", "--password-file", "/no/such/file"], "--password-file: cannot read"),
    ],
)
def test_an_unknown_name_or_a_duplicate_exits_2_with_one_line(role_groups, tmp_path, make_nodes, argv, says):
    make_nodes()
    _assert_one_line_refusal(_manage(*argv, tmp_path=tmp_path), argv[0], says)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_token_issued_at_the_shell_works_on_the_api(role_groups, tmp_path, researcher):
    result = _manage("issue_api_token", "rita", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert result.stdout == token + "\n"
    assert len(result.stderr.splitlines()) == 1
    response = Client(HTTP_AUTHORIZATION=f"Token {token}").get("/api/jobs/")
    assert response.status_code == 200


@pytest.mark.django_db
def test_revoke_api_token_by_its_prefix_or_itself_is_audited_and_the_token_dies(researcher, operator):
    from jobs.actions.accounts import issue_api_token

    row, token = issue_api_token(None, researcher, label="laptop")
    _other, other_token = issue_api_token(None, operator)
    out, _ = _run("revoke_api_token", row.prefix)
    assert out == f"Revoked API token {row.prefix}… of rita (laptop).\n"
    assert Client(HTTP_AUTHORIZATION=f"Token {token}").get("/api/jobs/").status_code == 401
    assert Client(HTTP_AUTHORIZATION=f"Token {other_token}").get("/api/jobs/").status_code == 200
    event = ElasticEvent.objects.filter(kind="token_revoked").get()
    assert event.actor == "system" and event.reason["inputs"] == {"user": "rita", "token": f"{row.prefix}…",
                                                                  "label": "laptop"}
    assert token not in str(event.reason)
    out, _ = _run("revoke_api_token", other_token)  # the whole token, as a script holds it
    assert out == f"Revoked API token {other_token[5:11]}… of olive.\n"


@pytest.mark.django_db
def test_a_tokens_prefix_never_begins_with_a_dash_so_the_command_line_can_name_it(researcher, monkeypatch):
    """Found when CI drew a token whose prefix was '-gbgG0': ``revoke_api_token -gbgG0`` read it
    as an option and refused with argparse's "prefix is required"."""
    import secrets

    from jobs.actions.accounts import issue_api_token

    drawn = iter(["-gbgG0" + "x" * 37, "gbgG0x" + "x" * 37])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(drawn))
    row, token = issue_api_token(None, researcher)
    assert row.prefix == "gbgG0x" and token == "omni_gbgG0x" + "x" * 37
    out, _ = _run("revoke_api_token", row.prefix)
    assert out.startswith("Revoked API token gbgG0x… of rita")


@pytest.mark.django_db
def test_revoke_api_token_refuses_what_it_cannot_name_exactly(researcher, operator):
    from jobs.actions.accounts import issue_api_token

    row, _ = issue_api_token(None, researcher)
    twin, _ = issue_api_token(None, operator)
    ApiToken.objects.filter(pk=twin.pk).update(prefix=row.prefix)  # two tokens that begin alike
    refusals = [
        (["revoke_api_token", "abc"], "PREFIX: 'abc' is shorter than a token's 6 characters"),
        (["revoke_api_token", "zzzzzz"], "no API token begins with 'zzzzzz'"),
        (["revoke_api_token", row.prefix], f"2 live API tokens begin with {row.prefix!r} (olive, rita): name one with --user"),
        (["revoke_api_token", "omni_" + "x" * 40], "no API token is that token"),
    ]
    for argv, says in refusals:
        with pytest.raises(CommandError) as refused:
            _run(*argv)
        assert refused.value.returncode == 2 and says in str(refused.value), argv
    assert not ApiToken.objects.filter(revoked_at__isnull=False).exists()
    _run("revoke_api_token", row.prefix, "--user", "rita")
    with pytest.raises(CommandError) as again:
        _run("revoke_api_token", row.prefix, "--user", "rita")
    assert again.value.returncode == 2 and f"API token {row.prefix}… was already revoked at " in str(again.value)
    assert ElasticEvent.objects.filter(kind="token_revoked").count() == 1

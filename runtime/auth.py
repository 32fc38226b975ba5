"""Per-role Redis credentials: user names from the config, passwords from the environment.

With ``auth.enabled`` every process connects as the ACL user of its role (protocol/roles.py;
the users are made by queues/acl.py): the user name is ``auth.user`` filled in with the run
and the role; the password is read from the environment variable named by
``auth.password_env``, so it is never in a TOML file, on a command line or in a log.
``streamrl up`` generates a random password per role, creates the
users with the admin URL's credentials and gives each child process only its own role's
password and a URL without credentials. For actors started one by one, ``streamrl acl apply``
creates the users from passwords set in its environment.

The operator commands (``streamrl status``, ``dlq``, ``replay``, ``report``) connect as the
``admin`` role where its password is set (:func:`ops_url`), else with the URL as given.
Creating users always takes the URL's own user (allowed ``ACL SETUSER``), never a role.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

import trio

from streamrl.config.schema import ENV_REDIS_URL, Config, ConfigError
from streamrl.protocol.names import Names
from streamrl.protocol.roles import OPERATOR_ROLES, ROLES, apply_acls
from streamrl.queues.acl import Credentials, missing_users, role_url
from streamrl.queues.client import Reconnect, RedisClient
from streamrl.queues.operations import BrokerError
from streamrl.runtime.logs import get_logger


def role_credentials(
    config: Config, role: str, environ: Mapping[str, str] = os.environ
) -> Credentials:
    """``role``'s user and its password from the environment; :class:`ConfigError` if unset."""
    variable = config.auth.password_env_of(role)
    password = environ.get(variable)
    if not password:
        raise ConfigError(
            f"auth.enabled: the password of role {role!r} is not set (environment variable "
            f"${variable}); `streamrl up` sets it for its own actors"
        )
    return Credentials(config.auth.user_of(config.run.name, role), password)


def credentials_for_apply(
    config: Config, environ: Mapping[str, str] = os.environ
) -> dict[str, Credentials]:
    """The credentials ``streamrl acl apply`` creates users from: every actor role's (each
    password required, else :class:`ConfigError`) and an operator role's where its password
    is set."""
    out = {}
    for role in ROLES:
        if role in OPERATOR_ROLES and not environ.get(config.auth.password_env_of(role)):
            continue
        out[role] = role_credentials(config, role, environ)
    return out


def ops_url(config: Config, environ: Mapping[str, str] = os.environ) -> str:
    """The Redis URL of the operator commands: with ``auth.enabled`` and the ``admin`` role's
    password in the environment, ``run.redis_url`` with the admin role's user (its own run's
    keys, no administrative command; protocol/roles.py); otherwise ``run.redis_url`` as given."""
    url = config.run.redis_url
    password = environ.get(config.auth.password_env_of("admin"))
    if not (config.auth.enabled and url and password):
        return url
    return role_url(url, Credentials(config.auth.user_of(config.run.name, "admin"), password))


def credentials_for_up(
    config: Config, environ: Mapping[str, str] = os.environ
) -> dict[str, Credentials]:
    """Every role's credentials: the password from the environment if set, else a random one."""
    out = {}
    for role in ROLES:
        password = environ.get(config.auth.password_env_of(role)) or secrets.token_hex(16)
        out[role] = Credentials(config.auth.user_of(config.run.name, role), password)
    return out


def actor_url(config: Config, role: str, password: str | None = None) -> str:
    """The Redis URL a process of ``role`` connects with: with auth on, ``run.redis_url`` with
    the role's own user and password (``password``, else from the environment)."""
    if not config.auth.enabled:
        return config.run.redis_url
    if password is not None:
        creds = Credentials(config.auth.user_of(config.run.name, role), password)
    else:
        creds = role_credentials(config, role)
    return role_url(config.run.redis_url, creds)


async def apply_role_users(
    config: Config, admin_url: str, credentials: Mapping[str, Credentials]
) -> None:
    """Create or update the role users of this run, connected with ``admin_url`` (a user
    allowed ``ACL SETUSER``: the URL's own, not the ``admin`` role)."""
    admin = RedisClient(admin_url, max_connections=2)
    try:
        shards = config.queues.shards
        await apply_acls(
            admin, Names(config.run.name), credentials, shards=shards if shards > 1 else 0
        )
    finally:
        admin.close()


ROLE_USERS_CHECK_S = 2.0
"""How often ``streamrl up`` checks that the run's role users still exist: well inside the
actors' reconnect window (``Reconnect.timeout_s``, 60 s), one ``ACL USERS`` each time."""


async def serve_role_users(
    config: Config,
    admin_url: str,
    credentials: Mapping[str, Credentials],
    *,
    interval_s: float = ROLE_USERS_CHECK_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep this run's role users on the server for as long as ``up`` runs: every
    ``interval_s`` check they exist (admin URL) and, where any is missing, create them all
    again (:func:`apply_role_users`). A Redis without an ACL file keeps users in memory only,
    so its restart loses them; the actors' logins are refused until they are back, which
    the actors ride out (an ``AuthenticationError`` is retried like a lost connection,
    queues/client.py) and then go on where they were. Redis unreachable or refusing: tried
    again at the next interval; this loop never ends the run."""
    log = get_logger()
    users = [c.user for c in credentials.values()]
    admin = RedisClient(admin_url, max_connections=2, reconnect=Reconnect(timeout_s=0.0))
    try:
        task_status.started()
        while True:
            await trio.sleep(interval_s)
            try:
                missing = await missing_users(admin, users)
                if missing:
                    await apply_role_users(config, admin_url, credentials)
            except (BrokerError, RuntimeError) as exc:  # down, loading; apply refused
                log.info("role users not checked", error=f"{type(exc).__name__}: {exc}")
                continue
            if missing:
                log.warning("role users were missing, created again", users=missing)
                print(f"streamrl: Redis had lost {len(missing)} of the run's ACL users "
                      "(restarted without an ACL file?): created them again", flush=True)
    finally:
        admin.close()


def child_environment(
    config: Config,
    base: Mapping[str, str],
    role: str,
    url: str,
    credentials: Mapping[str, Credentials],
) -> dict[str, str]:
    """The environment of a child process of ``role``: ``url`` as the Redis URL and, when
    ``credentials`` are given, its own role's password and no other."""
    others = {config.auth.password_env_of(r) for r in ROLES}
    env = {k: v for k, v in base.items() if k not in others}
    env.update({ENV_REDIS_URL: url, "PYTHONUNBUFFERED": "1"})
    if role in credentials:
        env[config.auth.password_env_of(role)] = credentials[role].password
    return env

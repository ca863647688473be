"""The per-user keyring: authentication with no configuration, for a pool on a shared host.

With no keyring configured (`KVPOOL_AUTH_FILE` unset), the pool's servers and the SDK use a
keyring of their user's own, made on first use:

    $KVPOOL_LOCAL_DIR, else $XDG_CONFIG_HOME/kvpool, else ~/.config/kvpool   (0700)
        keyring.toml    one principal, `node`, with a random secret          (0600)
        admin.token     the admin API's bearer token                         (0600)
        metrics.token   the token of a node's /metrics                      (0600)

Every process of that user finds the same files, so the owner's servers and clients prove the
same secret with no setup at all; another user cannot read them (the directory is 0700 and the
files 0600, refused otherwise, as ssh refuses a readable key), so the pool refuses them at the
first bytes of every connection, on the RPC and the data port (and the admin API without the
token). Protected mode is unchanged: it is the configured keyring that allows a non-loopback bind.

Why a file and not peer credentials: the pool's data path is TCP on loopback as well as unix
sockets, and a TCP peer's uid is not something the server can ask for portably (SO_PEERCRED is for
unix sockets; mapping a loopback connection to its owner through /proc or netlink is Linux-only
and racy); a shared secret the filesystem protects works the same on every transport and is the
same mechanism as a configured keyring, so there is one code path. (Jupyter's token in a 0600
runtime file is the same idea.)

`KVPOOL_LOCAL_AUTH=off` (`[security] local_auth = false`) turns it off: no keyring, every loopback connection served, as before
(for a host with one user, or a benchmark of the unauthenticated path).
Invariants: files are created atomically (a temporary file linked into place: two processes
starting at once agree on one secret) and never overwritten; a directory or file another user
owns, or that others may read, is refused with how to fix it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from kvpool.config import current_settings
from kvpool.errors import InvalidArgument
from kvpool.security.keyring import Keyring

# `[security] local_auth` and `local_dir` by their variables: what a child process must share with
# its parent to find the same keyring
LOCAL_ENV = "KVPOOL_LOCAL_AUTH"
DIR_ENV = "KVPOOL_LOCAL_DIR"
ENV_VARS = (LOCAL_ENV, DIR_ENV)
_cache: dict[str, tuple[float, Keyring]] = {}


def enabled() -> bool:
    return current_settings().security.local_auth


def local_dir() -> Path:
    where = current_settings().security.local_dir
    if where:
        return Path(where)
    # the XDG base directory convention (like HOME, the platform's, not one of kvpool's settings)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvpool"


def child_env() -> dict[str, str]:
    """The variables that make a child process use the keyring this one uses (or none), however
    this one was configured (environment, `KVPOOL_CONFIG`, `--set`): for launchers that clear the
    other `KVPOOL_*` settings of their children (`kvpool.tools.launch.processes.clean_env`)."""
    return {DIR_ENV: str(local_dir())} if enabled() else {LOCAL_ENV: "off"}


def _private_dir() -> Path:
    """The directory, made 0700 if missing; refused when another user owns it or others may enter."""
    path = local_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise InvalidArgument(f"cannot make the per-user keyring directory {path}: {exc.strerror or exc}; set "
                              f"{DIR_ENV} to a private directory, KVPOOL_AUTH_FILE to a keyring, or {LOCAL_ENV}=off "
                              "(docs/security.md)") from None
    return _private(path, st, "the per-user keyring directory ", "700")


def _private(path: Path, st: os.stat_result, what: str, mode: str) -> Path:
    """`path`, unless another user owns it or others may use it."""
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgument(f"{what}{path} is not private (owner uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o}); run: chmod {mode} {path} (it must be yours)")
    return path


def _create(path: Path, text: str) -> None:
    """Write `path` (0600) unless it exists; whoever links it first wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _file(name: str, make: str) -> Path:
    path = _private_dir() / name
    if not path.exists():
        _create(path, make)
    return _private(path, path.stat(), "", "600")


def local_keyring() -> Keyring | None:
    """This user's keyring (made on first use), or None when `KVPOOL_LOCAL_AUTH=off`."""
    if not enabled():
        return None
    path = _file("keyring.toml", "# kvpool's per-user keyring, made on first use (docs/security.md). Keep it 0600.\n"
                                 f'[principals.node]\nrole = "node"\nsecret = "{secrets.token_urlsafe(32)}"\n')
    mtime = path.stat().st_mtime
    cached = _cache.get(str(path))
    if cached is None or cached[0] != mtime:
        ring = Keyring.load(path)
        ring.local = True
        cached = _cache[str(path)] = (mtime, ring)
    return cached[1]


def local_token(name: str) -> str | None:
    """This user's `name` token ("admin", "metrics"), made on first use; None when off."""
    if not enabled():
        return None
    return _file(f"{name}.token", secrets.token_urlsafe(32) + "\n").read_text().strip()


def resolve(auth_file: str | os.PathLike | None) -> Keyring | None:
    """The keyring a service or client uses: the configured one (`auth_file`, else
    `KVPOOL_AUTH_FILE`), else this user's (unless `KVPOOL_LOCAL_AUTH=off`)."""
    from kvpool.security.keyring import load_keyring

    configured = load_keyring(auth_file)
    return configured if configured is not None else local_keyring()

"""How `serve` and `router` listen: uvicorn's settings from the command line.

HTTPS: uvicorn reads the certificate and key itself when it starts listening, which for `serve`
is after the model has loaded (minutes, for a large one); a wrong path or a key that does not
match the certificate should fail at once, with the flag named, so they are checked first.
"""

from __future__ import annotations

import argparse
import logging
import socket
import ssl
import sys
from typing import Any

import uvicorn


def uvicorn_tls_options(certfile: str | None, keyfile: str | None,
                        password: str | None = None) -> dict[str, Any]:
    """uvicorn's `ssl_certfile` / `ssl_keyfile` / `ssl_keyfile_password` settings, or {} for
    plain HTTP. Raises ValueError naming the flag for a key without a certificate, or files
    that do not load (an encrypted key without its password among them)."""
    if certfile is None:
        if keyfile is not None or password is not None:
            raise ValueError("--ssl-keyfile and --ssl-keyfile-password need --ssl-certfile (the "
                             "certificate the key signs for)")
        return {}
    try:
        # The password as given, or "" for none: OpenSSL would otherwise ask for an encrypted
        # key's passphrase on the terminal, and a server has nobody there to answer.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            certfile, keyfile, password=password or "")
    except (OSError, ssl.SSLError) as exc:  # missing or unreadable file, bad PEM, key mismatch
        files = f"--ssl-certfile {certfile}" + (f" / --ssl-keyfile {keyfile}" if keyfile else "")
        hint = "" if password else "; an encrypted key needs --ssl-keyfile-password"
        raise ValueError(f"{files}: cannot load the certificate and key ({exc}{hint})") from exc
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile, "ssl_keyfile_password": password}


def uvicorn_config(app: Any, args: argparse.Namespace, tls: dict[str, Any],
                   **settings: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` from --host, --port, --log-level, --root-path and --access-log,
    with the checked `tls` options and any other uvicorn `settings`."""
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            root_path=getattr(args, "root_path", ""), **tls, **settings)
    if getattr(args, "access_log", False):
        # uvicorn set its access logger to --log-level just now; its lines are INFO.
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now, as vLLM binds it before the model loads: a port in use
    fails at once (ValueError naming --host / --port) instead of after minutes of loading, and
    nothing else can take the port meanwhile. Hand it to `AnnouncingServer.run(sockets=[it])`."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--host {host}: cannot listen there ({exc})") from exc
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there "
                         f"({exc.strerror or exc})") from exc
    sock.set_inheritable(True)
    return sock


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that says, on stderr, once it listens: uvicorn's own line is INFO, which
    the default --log-level (warning) hides, and a server that starts in silence leaves its user
    guessing when it is ready."""

    def __init__(self, config: uvicorn.Config, what: str) -> None:
        super().__init__(config)
        self._what = what

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            scheme = "https" if self.config.ssl_certfile else "http"
            print(f"ksana-llm: {self._what} on {scheme}://{self.config.host}:{self.config.port} "
                  "(Ctrl-C to stop)", file=sys.stderr, flush=True)

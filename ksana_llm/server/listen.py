"""How `serve` and `router` listen: uvicorn's settings from the command line.

HTTPS: uvicorn reads the certificate and key itself when it starts listening, which for `serve`
is after the model has loaded (minutes, for a large one); a wrong path or a key that does not
match the certificate should fail at once, with the flag named, so they are checked first.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from typing import Any


def uvicorn_tls_options(certfile: str | None, keyfile: str | None) -> dict[str, Any]:
    """uvicorn's `ssl_certfile` / `ssl_keyfile` settings, or {} for plain HTTP. Raises
    ValueError naming the flag for a key without a certificate, or files that do not load."""
    if certfile is None:
        if keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate it signs for)")
        return {}
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:  # missing or unreadable file, bad PEM, key mismatch
        files = f"--ssl-certfile {certfile}" + (f" / --ssl-keyfile {keyfile}" if keyfile else "")
        raise ValueError(f"{files}: cannot load the certificate and key ({exc})") from exc
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile}


def uvicorn_config(app: Any, args: argparse.Namespace, tls: dict[str, Any], **settings: Any) -> Any:
    """uvicorn's Config for `app` from --host, --port, --log-level and --access-log, with the
    checked `tls` options and any other uvicorn `settings`."""
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            **tls, **settings)
    if getattr(args, "access_log", False):
        # uvicorn set its access logger to --log-level just now; its lines are INFO.
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config

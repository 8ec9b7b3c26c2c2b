"""HTTPS for `serve` and `router`: the certificate and key files, checked before anything loads.

uvicorn reads the files itself when it starts listening, which for `serve` is after the model
has loaded (minutes, for a large one); a wrong path or a key that does not match the
certificate should fail at once, with the flag named.
"""

from __future__ import annotations

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

"""Benchmark-only workaround, loaded into every role process through PYTHONPATH when
KUBEDISTILL_BENCH_KEEPALIVE is set (bench/_common.py does so by default; --no-keepalive-fix turns
it off).

Why: the role servers run uvicorn with its default keep-alive timeout (5 s) and the driver's httpx
client keeps idle connections for its default 5 s too. When a connection idles for just about 5 s
(e.g. the rollout server waiting while the trainer trains in sync/oneStepOff), the server closes it
while the client still considers it reusable, and the next /generate fails with httpx.ReadError.
Expiring the client's idle connections after 1 s (well inside the server's timeout) avoids the
race; nothing else changes. Remove this once runtime/clients.py sets keepalive_expiry itself.
"""

import os

if os.environ.get("KUBEDISTILL_BENCH_KEEPALIVE"):
    try:
        import httpx
    except ImportError:  # a process without httpx never opens such a connection
        httpx = None
    if httpx is not None:
        _limits_init = httpx.Limits.__init__

        def _short_keepalive(self, *args, keepalive_expiry: float = 1.0, **kwargs) -> None:
            _limits_init(self, *args, keepalive_expiry=keepalive_expiry, **kwargs)

        httpx.Limits.__init__ = _short_keepalive

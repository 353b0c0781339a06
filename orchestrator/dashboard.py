"""Reaching a Ray dashboard that has token authentication on, as Ray 2.60 clusters do by default.

Ray's own clients only send the token when ``RAY_AUTH_MODE=token`` is set in the client's
environment; a laptop talking to a cluster usually has the token but not that variable. So we
look the token up the way Ray does (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
``~/.ray/auth_token``) and send it whenever there is one. The browser side is Ray's: the
dashboard page asks for the token once and keeps it in an HttpOnly cookie.
"""

from __future__ import annotations

import requests

from orchestrator.errors import UserError
from orchestrator.ray_internals import auth_token_loader
from orchestrator.ray_token import TOKEN_SOURCES


def auth_headers() -> dict[str, str]:
    """``{"authorization": "Bearer <token>"}`` from Ray's token lookup, or ``{}`` with no token."""
    from ray.exceptions import AuthenticationError

    loader = auth_token_loader()
    loader.reset_cache()  # the token may have been written since Ray last looked
    try:
        return dict(loader.get_token_for_http_header(ignore_auth_mode=True))
    except AuthenticationError as exc:
        raise UserError(f"Ray's authentication token could not be read ({exc}); it is looked up in {TOKEN_SOURCES}") from None


def token_required(url: str) -> bool:
    """Whether the dashboard at ``url`` wants a token; asks its public ``/api/authentication_mode``."""
    try:
        response = requests.get(f"{url.rstrip('/')}/api/authentication_mode", timeout=10)
        return response.ok and response.json().get("authentication_mode") == "token"
    except (requests.RequestException, ValueError):
        return False


def job_page(url: str, submission_id: str) -> str:
    """The dashboard page of one job (the UI routes with a ``#`` fragment)."""
    return f"{url.rstrip('/')}/#/jobs/{submission_id}"


def how_to_open(url: str, needs_token: bool) -> str:
    """The lines to print so a user can open the dashboard at ``url`` in a browser."""
    lines = [f"Ray dashboard: {url}"]
    if needs_token:
        lines.append(
            "  It asks for the cluster's token once: paste the output of `ray get-auth-token` "
            "(run it where the cluster was started)."
        )
    return "\n".join(lines)


def metrics_line(nodes: list[dict]) -> str | None:
    """Where this sweep's Ray exports its metrics (``ray_orchestrator_*`` among Ray's own), from
    ``ray.nodes()``: a port Ray picks at start, which ``session_latest`` would name only while no
    other Ray started since on this machine. None where no node says."""
    ports = [(node.get("NodeManagerAddress"), node.get("MetricsExportPort")) for node in nodes if node.get("Alive", True)]
    urls = [f"http://{host}:{port}/metrics" for host, port in ports if host and port]
    return f"  Its metrics (Prometheus text, ray_orchestrator_*): {', '.join(urls)}" if urls else None

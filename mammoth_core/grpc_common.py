"""gRPC plumbing shared by the AR and DiT stages (and their clients).

- `server_options` / `channel_options`: the same max send AND receive message size on both sides
  (``max_message_bytes``), so a message over the limit fails with RESOURCE_EXHAUSTED on whichever
  side sees it first instead of hanging; keepalive settings whose client ping period is longer than
  the server's minimum ping interval (a client pinging faster gets GOAWAY ``too_many_pings``).
- `TokenAuthInterceptor`: stage-to-stage tokens, ``authorization: Bearer <token>``; every method
  except ``grpc.health.v1.Health/Check`` (`OPEN_METHOD`) answers UNAUTHENTICATED without a known token. With
  per-role tokens (``gateway_token_file``, ``ar_token_file``) each token names its caller's role and
  `METHOD_ROLES` says which role may call which RPC (PERMISSION_DENIED otherwise): a NetworkPolicy
  cannot tell RPCs apart, the token can. The shared ``auth_token_file`` token grants every role.
  Secure by default: a stage with no token configured refuses every stage RPC (UNAUTHENTICATED,
  the message says what to configure) unless it was started with ``insecure_no_auth``.
- `StageAuth`: the same decision for non-gRPC admin endpoints (the DiT's ``/debug/profile``).
- `auth_metadata`: the matching client metadata.
- `server_credentials` / `channel_credentials`: optional TLS (``tls_cert_file``, ``tls_key_file``,
  ``tls_ca_file``; with a CA the server also requires client certificates).
- `HealthReporter`: ``grpc.health.v1`` servicer with a status per service name (``""`` and e.g.
  ``mammoth.v1.DiT``); `mammoth_core.drain` flips everything to NOT_SERVING on SIGTERM and stops the
  server once the work in flight has ended.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pathlib
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from mammoth_core.addresses import format_address
from mammoth_core.logging import RateLimitFilter
from mammoth_core.runtime import cannot_listen

logger = logging.getLogger(__name__)
#: Refused stage calls (no or a wrong token, a role that may not call the method): one WARNING per
#: 10 s at most, with the count suppressed since, so a flood of bad calls cannot flood the log.
auth_logger = logging.getLogger(f"{__name__}.auth")
auth_logger.addFilter(RateLimitFilter())

HEALTH_SERVICE = "grpc.health.v1.Health"
AUTH_HEADER = "authorization"

#: Caller roles of the per-role stage tokens. `ROLE_ANY` is the shared token's (every role).
ROLE_GATEWAY = "gateway"
ROLE_AR = "ar"
ROLE_ANY = "*"
#: The DiT profiler's admin endpoint (HTTP, on the metrics port), authorised like an RPC.
PROFILE_METHOD = "/debug/profile"
#: The one RPC open to callers without a token: kubelet's gRPC probes carry none. ``Health/Watch``
#: is not: a stream holds its request for as long as the caller keeps it open (a break-it pass held
#: 6,000 of them, 2.5 GB of a DiT's memory, without a token), so it needs a stage token.
OPEN_METHOD = f"/{HEALTH_SERVICE}/Check"
#: Which caller role may call which RPC (full method name). `OPEN_METHOD` needs no token; a method
#: missing here is refused to every per-role token (only the shared token may call it).
METHOD_ROLES: dict[str, frozenset[str]] = {
    f"/{HEALTH_SERVICE}/Watch": frozenset({ROLE_GATEWAY, ROLE_AR}),
    "/mammoth.v1.DiT/Generate": frozenset({ROLE_GATEWAY}),
    "/mammoth.v1.DiT/PushConditions": frozenset({ROLE_AR}),
    "/mammoth.v1.AR/Generate": frozenset({ROLE_GATEWAY}),
    PROFILE_METHOD: frozenset({ROLE_GATEWAY}),
}
#: Why an unconfigured stage refuses its RPCs (secure by default).
NO_TOKEN_CONFIGURED = (
    "this stage has no stage token configured and refuses unauthenticated calls: set "
    "gateway_token_file and ar_token_file (or auth_token_file), or start it with "
    "--insecure-no-auth true (development only)"
)

# Keepalive (milliseconds). Clients ping an idle connection every 30 s and give up after 10 s
# without an answer; servers accept pings every 10 s or slower (so the client never trips
# ``too_many_pings``) and ping their own idle clients every 60 s.
CLIENT_KEEPALIVE_TIME_MS = 30_000
SERVER_KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_MIN_PING_INTERVAL_MS = 10_000
# Connection bounds of a stage's server (its clients are a few gateway replicas and AR pods, each
# with one long-lived channel): a connection that has not finished the HTTP/2 handshake within 10 s
# is closed (gRPC's default is 120 s: a break-it pass held 600 silent connections open), one with no
# call in flight for 10 min is sent away (its client reconnects at its next call), and at most 512
# are accepted at once.
SERVER_HANDSHAKE_TIMEOUT_MS = 10_000
MAX_CONNECTION_IDLE_MS = 600_000
MAX_INCOMING_CONNECTIONS = 512


def _message_limits(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", int(max_message_bytes)),
        ("grpc.max_receive_message_length", int(max_message_bytes)),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for `grpc.aio.server`: message limits (bytes), server-side keepalive, and the
    connection bounds (handshake timeout, idle timeout, most connections at once)."""
    return _message_limits(max_message_bytes) + [
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_allowed_incoming_connections", MAX_INCOMING_CONNECTIONS),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for `grpc.aio.insecure_channel`: message limits (bytes) and client keepalive."""
    return _message_limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
    ]


def create_channel(
    target: str,
    max_message_bytes: int,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """A `grpc.aio` channel to ``target`` (``host:port`` or ``dns:///name:port``).

    Plaintext unless ``credentials`` (`channel_credentials`) is given; ``server_name`` overrides
    the name the server certificate is checked against (pods are dialled by IP address).
    """
    options = channel_options(max_message_bytes)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, credentials, options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the stage token (empty when ``token`` is None or empty)."""
    if not token:
        return ()
    return ((AUTH_HEADER, f"Bearer {token}"),)


def _bearer(metadata: Iterable[Any] | None) -> str | None:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key.lower() == AUTH_HEADER:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, credential = value.partition(" ")
            if scheme.lower() == "bearer":
                return credential.strip()
            return None
    return None


def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str):
    """A handler of the same kind as ``handler`` that aborts with ``code``."""

    async def unary(request_or_iterator, context):
        await context.abort(code, details)

    async def streaming(request_or_iterator, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class _Undecodable:
    """What a guarded request deserializer returns for bytes that do not parse (`decode_guarded`)."""

    def __init__(self, error: Exception) -> None:
        self.details = f"the request is not a valid message: {type(error).__name__}: {error}"


def decode_guarded(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with its request deserializer guarded: a request whose bytes do not parse ends the
    call INVALID_ARGUMENT naming the parse error, instead of gRPC's UNKNOWN and an ERROR traceback
    in the log (found by a break-it pass, 2026-12-03: garbage bytes with a valid token to
    ``AR.Generate``). Only single-request methods (``Generate``, health) are guarded; the
    client-streaming ``PushConditions`` takes raw bytes and checks them itself
    (`mammoth_core.chunk_stream`), so its handler is returned as it is, as is a handler without a
    deserializer."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return _Undecodable(exc)

    async def checked(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return request

    kwargs = dict(request_deserializer=deserialize, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_stream(request, context):
            responses = behavior(await checked(request, context), context)
            if not hasattr(responses, "__aiter__"):  # a coroutine that writes with `context.write`
                await responses
                return
            try:
                async for response in responses:
                    yield response
            finally:  # closed with this call (a cancelled stream runs the servicer's cleanup now)
                await responses.aclose()
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    behavior = handler.unary_unary

    async def unary_unary(request, context):
        return await behavior(await checked(request, context), context)
    return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """Applies `decode_guarded` to every handler (the innermost interceptor of `create_server`)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        return decode_guarded(await continuation(handler_call_details))


class StageAuth:
    """Who may call what on a stage: the token check shared by gRPC and the admin HTTP endpoint.

    Args:
        token: the shared stage token (grants every role); None or empty: no shared token.
        role_tokens: per-role tokens, role name (`ROLE_GATEWAY`, `ROLE_AR`) -> token; the role a
            presented token belongs to must be listed for the method in ``method_roles``.
        method_roles: full method name (``/mammoth.v1.DiT/Generate``) -> roles allowed to call it.
        insecure: with no token configured, let every call through (``insecure_no_auth``);
            without it an unconfigured stage refuses every call (`NO_TOKEN_CONFIGURED`).

    Tokens are compared in constant time, and every configured token is compared (the time does
    not tell which role matched).
    """

    def __init__(
        self,
        token: str | None = None,
        *,
        role_tokens: Mapping[str, str | None] | None = None,
        method_roles: Mapping[str, frozenset[str]] = METHOD_ROLES,
        insecure: bool = False,
    ):
        self._tokens: list[tuple[bytes, str]] = []
        for role, value in (role_tokens or {}).items():
            if value:
                self._tokens.append((value.encode(), role))
        if token:
            self._tokens.append((token.encode(), ROLE_ANY))
        self._method_roles = dict(method_roles)
        self.insecure = bool(insecure)

    @property
    def enabled(self) -> bool:
        """Whether any token is configured."""
        return bool(self._tokens)

    @property
    def open(self) -> bool:
        """Whether every call passes (no token configured and ``insecure``)."""
        return not self._tokens and self.insecure

    def role_of(self, presented: str | None) -> str | None:
        """The role of ``presented`` (`ROLE_ANY` for the shared token), or None when unknown."""
        if presented is None:
            return None
        candidate = presented.encode()
        role = None
        for value, name in self._tokens:
            if hmac.compare_digest(candidate, value) and role is None:
                role = name
        return role

    def check(self, method: str, presented: str | None) -> tuple[grpc.StatusCode, str] | None:
        """None when a caller presenting ``presented`` may call ``method``, else the refusal:
        UNAUTHENTICATED (no or unknown token, or no token configured at all) or PERMISSION_DENIED
        (a known token of a role ``method`` does not allow)."""
        if self.open:
            return None
        if not self._tokens:
            return grpc.StatusCode.UNAUTHENTICATED, NO_TOKEN_CONFIGURED
        role = self.role_of(presented)
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing or invalid stage token"
        if role == ROLE_ANY or role in self._method_roles.get(method, frozenset()):
            return None
        return grpc.StatusCode.PERMISSION_DENIED, f"the {role} token may not call {method}"

    def check_header(self, method: str, authorization: str | None) -> tuple[grpc.StatusCode, str] | None:
        """`check` for an HTTP ``Authorization`` header value (``Bearer <token>``)."""
        return self.check(method, _bearer(((AUTH_HEADER, authorization),) if authorization else ()))


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on every RPC except `OPEN_METHOD` (``Health/Check``).

    Takes the arguments of `StageAuth` (or a ready ``auth=``). A refused call aborts with the
    status `StageAuth.check` gives: UNAUTHENTICATED or PERMISSION_DENIED.
    """

    def __init__(
        self,
        token: str | None = None,
        *,
        role_tokens: Mapping[str, str | None] | None = None,
        method_roles: Mapping[str, frozenset[str]] = METHOD_ROLES,
        insecure: bool = False,
        auth: StageAuth | None = None,
    ):
        self.auth = auth or StageAuth(token, role_tokens=role_tokens, method_roles=method_roles,
                                      insecure=insecure)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if self.auth.open or handler is None:
            return handler
        method = handler_call_details.method or ""
        if method == OPEN_METHOD:
            return handler
        refusal = self.auth.check(method, _bearer(handler_call_details.invocation_metadata))
        if refusal is None:
            return handler
        auth_logger.warning("refused a stage call: %s %s: %s", method, refusal[0].name, refusal[1])
        return _abort_handler(handler, *refusal)


def create_server(
    max_message_bytes: int,
    auth_token: str | None,
    *,
    interceptors: Sequence[Any] = (),
    role_tokens: Mapping[str, str | None] | None = None,
    insecure: bool = False,
) -> grpc.aio.Server:
    """A `grpc.aio.server` with the shared options and the token interceptor.

    Args:
        max_message_bytes: send and receive limit of every message (bytes).
        auth_token: the shared stage token (every role), or None.
        interceptors: further server interceptors, run after the token check (then
            `DecodeGuardInterceptor`: requests that do not parse end INVALID_ARGUMENT).
        role_tokens: per-role tokens (see `StageAuth`).
        insecure: with no token at all, serve every RPC unauthenticated (``insecure_no_auth``);
            otherwise a server without tokens refuses every RPC but ``Health/Check`` (UNAUTHENTICATED).
    """
    chain = [*interceptors, DecodeGuardInterceptor()]
    auth = StageAuth(auth_token, role_tokens=role_tokens, insecure=insecure)
    if auth.open:
        logger.warning("insecure_no_auth: stage RPCs are served WITHOUT authentication")
    else:
        if not auth.enabled:
            logger.error("%s", NO_TOKEN_CONFIGURED)
        chain.insert(0, TokenAuthInterceptor(auth=auth))
    return grpc.aio.server(interceptors=chain, options=server_options(max_message_bytes))


def _read_bytes(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def server_credentials(
    cert_file: str | None, key_file: str | None, ca_file: str | None = None
) -> grpc.ServerCredentials | None:
    """TLS server credentials from PEM files, or None when ``cert_file`` is not set (plaintext).

    With ``ca_file`` the server requires and verifies client certificates (mutual TLS).

    Raises:
        ValueError: a certificate without its key (or the other way round).
        OSError: a file cannot be read.
    """
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    ca = _read_bytes(ca_file)
    return grpc.ssl_server_credentials(
        [(_read_bytes(key_file), _read_bytes(cert_file))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (verify the server against ``ca_file``; present ``cert_file``/
    ``key_file`` as client certificate when both are set), or None when ``ca_file`` is not set."""
    if not ca_file:
        return None
    client = (_read_bytes(key_file), _read_bytes(cert_file)) if cert_file and key_file else (None, None)
    return grpc.ssl_channel_credentials(
        root_certificates=_read_bytes(ca_file), private_key=client[0], certificate_chain=client[1]
    )


def add_port(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on ``host:port`` (TLS when ``credentials`` is set); returns the bound port. ``host``
    ``''`` is every interface: gRPC's ``[::]``, which takes IPv6 and IPv4 (IPv4 alone where the host
    has no IPv6), so a pod of an IPv6 cluster is reached on its address.

    Raises:
        mammoth_core.runtime.StageStartError: gRPC cannot bind it (`cannot_listen`, naming ``--port``).
    """
    address = format_address(host or "::", port)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..." (in use, not this machine's)
        raise cannot_listen(address, "--port", exc) from exc


class HealthReporter:
    """``grpc.health.v1`` health for one server, with a status per service name.

    Args:
        server: the `grpc.aio.Server` to add the health service to.
        services: service names reported (``""`` is always added), e.g. ``["mammoth.v1.DiT"]``.

    Every service starts NOT_SERVING; call `set_serving` once the model is loaded.
    """

    def __init__(self, server: grpc.aio.Server, services: Iterable[str]):
        self.servicer = HealthServicer()
        self.services = [""] + [s for s in services if s]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.draining = False

    async def set_all(self, status: int) -> None:
        """Set every service to ``status`` (a `health_pb2.HealthCheckResponse` enum value)."""
        for name in self.services:
            await self.servicer.set(name, status)

    async def set_serving(self) -> None:
        """Report SERVING for every service (unless draining)."""
        if not self.draining:
            await self.set_all(health_pb2.HealthCheckResponse.SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, permanently (later `set` calls are ignored)."""
        self.draining = True
        await self.servicer.enter_graceful_shutdown()

    def on_fatal_error(self, loop: asyncio.AbstractEventLoop) -> Callable[[BaseException], None]:
        """A callback any thread may call when the stage can no longer work (its engine's loop
        died): `enter_graceful_shutdown` on ``loop``, so the gateway and the kubelet take the
        replica out of rotation for good instead of probing it as live."""
        def failed(exc: BaseException) -> None:
            asyncio.run_coroutine_threadsafe(self.enter_graceful_shutdown(), loop)
        return failed

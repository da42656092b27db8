"""TLS and mutual TLS for every channel, and the client API's bearer token: built once here.

Every process takes the same three flags: `--tls-cert`/`--tls-key` are its own identity
(what a server presents, and what it presents as a client of another server), `--tls-ca`
the authority that signs its peers. A server given `--tls-ca` requires and verifies a
client certificate (mutual TLS); a channel given `--tls-ca` verifies the server against
it (without it, against the system roots). The bearer token (`--auth-token`, or the
environment variable `KVSERVICE_AUTH_TOKEN`) guards every RPC but health, on the proxy
and on the workers alike; the proxy and decode workers send it to the workers they call.
Under mutual TLS a worker may also admit only certain certificates (`--worker-peer-names`:
the identities of the proxy and the other workers), so that a client certificate, good
for the proxy's client API, cannot call a worker.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import ssl
from dataclasses import dataclass

import grpc

AUTH_TOKEN_ENV = "KVSERVICE_AUTH_TOKEN"


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Paths of PEM files; all None means plaintext."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TLSFiles:
        return cls(args.tls_cert, args.tls_key, args.tls_ca)

    @property
    def is_enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def to_args(self) -> list[str]:
        """The flags that give a child process the same files."""
        flags = []
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None:
                flags += [flag, path]
        return flags

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None without a certificate; with `ca`, clients must present a certificate it signed."""
        if self.cert is None or self.key is None:
            if self.ca is not None:
                raise ValueError("--tls-ca on a server needs --tls-cert and --tls-key")
            return None
        root = _read(self.ca) if self.ca is not None else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=root, require_client_auth=root is not None
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same identity for an HTTPS server (the OpenAI-compatible front); None without a
        certificate. With `ca`, clients must present a certificate it signed, as on gRPC."""
        if self.cert is None or self.key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None when TLS is off; otherwise verify the server by `ca` and present `cert` if given."""
        if not self.is_enabled:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca is not None else None,
            private_key=_read(self.key) if self.key is not None else None,
            certificate_chain=_read(self.cert) if self.cert is not None else None,
        )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries `token` (None: no token, no metadata)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def add_tls_arguments(parser: argparse.ArgumentParser, *, with_auth_token: bool = True) -> None:
    parser.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="this process's certificate chain (enables TLS; needs --tls-key)",
    )
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that signs the peers: servers then require client certificates (mutual TLS), "
        "clients verify servers by it",
    )
    if with_auth_token:
        parser.add_argument(
            "--auth-token",
            default=os.environ.get(AUTH_TOKEN_ENV),
            metavar="TOKEN",
            help=f"bearer token required by every RPC but health, and sent to the workers this process calls "
            f"(default: ${AUTH_TOKEN_ENV}; unset: no token)",
        )


def add_worker_peer_names_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-peer-names",
        nargs="+",
        default=None,
        metavar="NAME",
        help="mutual TLS: workers admit only callers whose client certificate has one of these names as its subject CN "
        "or a subject alternative name (the proxy's and the workers' identities), others get PERMISSION_DENIED; "
        "health stays open (default: any certificate --tls-ca signed)",
    )


def check_worker_peer_names(names: list[str] | None, tls: TLSFiles) -> None:
    """Peer names need client certificates to check: mutual TLS (`--tls-ca` with a certificate)."""
    if names is None:
        return
    if tls.ca is None or tls.cert is None:
        raise ValueError("--worker-peer-names needs mutual TLS (--tls-cert, --tls-key and --tls-ca)")
    if not all(names):
        raise ValueError("--worker-peer-names: a name is empty")


def _read(path: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None

"""TLS, mutual TLS and the bearer token across processes; KV pulls need their transfer's token.

One 1P1D cluster on the tiny model with mutual TLS on every channel (client -> proxy,
proxy -> workers, decode -> prefill), a bearer token on the proxy's client API, and
workers that admit only the workers' own certificate identity (`--worker-peer-names`).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import pathlib
import secrets
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from conftest import WORKER_RPCS, local_cluster, tiny_pull_request, worker_calls

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.connector.kv_transfer_service import PULL_KV_METHOD
from kvservice.runtime.grpc_options import GRPC_OPTIONS
from kvservice.runtime.tls import TLSFiles
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TOKEN = "s3cret-token"
WORKER_NAME = "kvservice"  # the common name of every process's certificate (pki["server"])
BLOCK_SIZE = 16
WORKER_ARGS = [
    "--num-blocks",
    "64",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-seqs",
    "8",
    "--num-threads",
    "1",
    "--grace-period",
    "2",
]
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 1, 4, 6, 10, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44], list(range(20, 60))]
MAX_TOKENS = 8


# ---------------------------------------------------------------- a small PKI


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: pathlib.Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def _certificate(
    subject: str,
    issuer_key: ec.EllipticCurvePrivateKey | None,
    issuer: x509.Name | None,
    *,
    is_ca: bool,
    san: bool = False,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer if issuer is not None else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if san else [])
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return key, builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TLSFiles]:
    """`server`: every process's identity (SAN 127.0.0.1, localhost); `client`: a user's; `rogue`: another CA's."""
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _certificate("kvservice test CA", None, None, is_ca=True)
    ca_path = root / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server_key, server_cert = _certificate(WORKER_NAME, ca_key, ca_cert.subject, is_ca=False, san=True)
    client_key, client_cert = _certificate("a client", ca_key, ca_cert.subject, is_ca=False)
    rogue_ca_key, rogue_ca_cert = _certificate("rogue CA", None, None, is_ca=True)
    rogue_key, rogue_cert = _certificate("a rogue client", rogue_ca_key, rogue_ca_cert.subject, is_ca=False)
    return {
        "server": TLSFiles(*_write(root / "server", server_key, server_cert), str(ca_path)),
        "client": TLSFiles(*_write(root / "client", client_key, client_cert), str(ca_path)),
        "rogue": TLSFiles(*_write(root / "rogue", rogue_key, rogue_cert), str(ca_path)),
        "ca_only": TLSFiles(ca=str(ca_path)),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(pki: dict[str, TLSFiles]) -> AsyncIterator[LocalCluster]:
    tls = pki["server"].to_args()
    async with local_cluster(
        "tiny",
        num_prefill=1,
        num_decode=1,
        worker_args=[*WORKER_ARGS, *tls, "--worker-peer-names", WORKER_NAME],
        proxy_args=[*tls, "--auth-token", TOKEN, "--http-port", "0"],
        client_credentials=pki["client"].channel_credentials(),
        grace_period=2,
    ) as c:
        yield c


async def greedy(client: KVServiceClient) -> list[list[int]]:
    results = []
    for prompt in PROMPTS:
        completion = await client.complete(prompt, timeout=60, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        results.append(completion.token_ids)
    return results


# ---------------------------------------------------------------- the client API


async def test_greedy_over_mutual_tls_matches_plain_colocated(cluster: LocalCluster, pki: dict[str, TLSFiles]) -> None:
    async with KVServiceClient(cluster.address, pki["client"].channel_credentials(), TOKEN) as client:
        over_tls = await greedy(client)
    async with local_cluster("tiny", colocated=True, worker_args=WORKER_ARGS, grace_period=2) as plain:
        async with KVServiceClient(plain.address) as client:
            expected = await greedy(client)
    assert over_tls == expected
    assert all(len(ids) == MAX_TOKENS for ids in over_tls)


@pytest.mark.parametrize("who", ["plaintext", "no_client_cert", "rogue_cert"])
async def test_client_without_a_trusted_certificate_is_refused(
    cluster: LocalCluster, pki: dict[str, TLSFiles], who: str
) -> None:
    credentials = {
        "plaintext": None,
        "no_client_cert": pki["ca_only"].channel_credentials(),
        "rogue_cert": pki["rogue"].channel_credentials(),
    }[who]
    async with KVServiceClient(cluster.address, credentials, TOKEN) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.complete(PROMPTS[0], timeout=10, max_tokens=2, temperature=0)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1]])
async def test_missing_or_wrong_bearer_token_is_unauthenticated(
    cluster: LocalCluster, pki: dict[str, TLSFiles], token: str | None
) -> None:
    async with KVServiceClient(cluster.address, pki["client"].channel_credentials(), token) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.complete(PROMPTS[0], timeout=10, max_tokens=2, temperature=0)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught_stream:
            async for _ in client.generate(PROMPTS[0], timeout=10, max_tokens=2, temperature=0):
                pass
        assert caught_stream.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # Health stays open: probes carry no token.
        assert await client.health() == "SERVING"


async def test_right_token_and_certificate_work(cluster: LocalCluster, pki: dict[str, TLSFiles]) -> None:
    async with KVServiceClient(cluster.address, pki["client"].channel_credentials(), TOKEN) as client:
        completion = await client.complete(PROMPTS[1], timeout=60, max_tokens=3, temperature=0, ignore_eos=True)
        stats = await client.stats()
    assert len(completion.token_ids) == 3
    assert {w.address for w in stats.workers} == {*cluster.prefill_addresses, *cluster.decode_addresses}
    assert all(w.is_healthy for w in stats.workers)
    # The proxy's and the decode worker's certificate names a worker: the KV came over the pull.
    [decode] = [w.stats for w in stats.workers if w.address in cluster.decode_addresses]
    assert decode.kv_receiving.num_transfers >= 1 and decode.kv_receiving.num_failed_transfers == 0


async def test_a_client_certificate_cannot_call_a_worker(cluster: LocalCluster, pki: dict[str, TLSFiles]) -> None:
    """Signed by the same CA, but not named in --worker-peer-names: every worker RPC but health is refused."""
    for role, address in [("prefill", cluster.prefill_addresses[0]), ("decode", cluster.decode_addresses[0])]:
        async with grpc.aio.secure_channel(address, pki["client"].channel_credentials()) as channel:
            calls = worker_calls(channel)
            for name in WORKER_RPCS[role]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await calls[name]()
                assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED, (role, name, refused.value)
                assert "--worker-peer-names" in (refused.value.details() or "")
        async with KVServiceClient(address, pki["client"].channel_credentials()) as client:
            assert await client.health() == "SERVING"  # probes need no worker identity
        async with KVServiceClient(address, pki["server"].channel_credentials()) as worker:
            assert (await worker.stats()).num_blocks_total > 0  # a worker's identity is let through


async def test_worker_refuses_plaintext_and_rogue_peers(cluster: LocalCluster, pki: dict[str, TLSFiles]) -> None:
    for credentials in (None, pki["rogue"].channel_credentials()):
        channel = (
            grpc.aio.secure_channel(cluster.prefill_addresses[0], credentials)
            if credentials is not None
            else grpc.aio.insecure_channel(cluster.prefill_addresses[0])
        )
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------- KV pulls


async def _pull(
    channel: grpc.aio.Channel, request: pb.PullKVRequest, timeout: float
) -> tuple[list[bytes], grpc.StatusCode]:
    """Every frame the prefill worker sends, and the call's final code."""
    call = channel.unary_stream(
        PULL_KV_METHOD, request_serializer=pb.PullKVRequest.SerializeToString, response_deserializer=None
    )(request, timeout=timeout)
    frames: list[bytes] = []
    try:
        async for frame in call:
            frames.append(frame)
    except grpc.aio.AioRpcError as e:
        return frames, e.code()
    return frames, grpc.StatusCode.OK


async def test_kv_pull_needs_the_transfer_token(cluster: LocalCluster, pki: dict[str, TLSFiles]) -> None:
    """A peer with a worker's certificate still gets no KV without the transfer's own token."""
    address = cluster.prefill_addresses[0]
    async with grpc.aio.secure_channel(address, pki["server"].channel_credentials(), options=GRPC_OPTIONS) as channel:
        # Never registered: refused (or left to its registration deadline), never data.
        frames, code = await _pull(
            channel, tiny_pull_request(BLOCK_SIZE, secrets.token_hex(8), secrets.token_bytes(16)), timeout=3
        )
        assert frames == [] and code in (
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )

        request_id, token = f"sec-{secrets.token_hex(4)}", secrets.token_bytes(16)
        prefill = pb.PrefillRequest(
            request=pb.GenerateRequest(
                request_id=request_id,
                token_ids=pb.TokenIds(ids=PROMPTS[2]),
                sampling_params=pb.SamplingParams(max_tokens=4, temperature=0),
            ),
            transfer_token=token,
        )
        await pb_grpc.WorkerStub(channel).Prefill(prefill, timeout=60)
        for wrong in (secrets.token_bytes(16), b"", token[:-1]):
            frames, code = await _pull(channel, tiny_pull_request(BLOCK_SIZE, request_id, wrong), timeout=10)
            assert (frames, code) == ([], grpc.StatusCode.PERMISSION_DENIED)
        # The right token gets the KV (the transfer was there all along), once.
        frames, code = await _pull(channel, tiny_pull_request(BLOCK_SIZE, request_id, token), timeout=30)
        assert code is grpc.StatusCode.OK and len(frames) > 1
        # Pulled once, released: a replay gets nothing (refused, or left waiting for a new registration).
        frames, code = await _pull(channel, tiny_pull_request(BLOCK_SIZE, request_id, token), timeout=3)
        assert frames == [] and code in (
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )


async def test_openai_front_is_https_with_mutual_tls_and_the_token(
    pki: dict[str, TLSFiles], cluster: LocalCluster
) -> None:
    """The HTTP front has the proxy's identity, wants a client certificate and the token."""
    import ssl

    import openai

    http_address = cluster.child("proxy").http_address
    client_files = pki["client"]

    def complete(api_key: str, scheme: str = "https", with_cert: bool = True) -> str:
        context = ssl.create_default_context(cafile=client_files.ca)
        if with_cert:
            context.load_cert_chain(client_files.cert, client_files.key)
        with openai.DefaultHttpxClient(verify=context, timeout=30) as http:
            api = openai.OpenAI(
                base_url=f"{scheme}://{http_address}/v1", api_key=api_key, http_client=http, max_retries=0
            )
            out = api.completions.create(model="kvservice", prompt=[5, 6, 7], max_tokens=4, temperature=0)
            return out.choices[0].text

    assert await asyncio.to_thread(complete, TOKEN) is not None
    with pytest.raises(openai.AuthenticationError):
        await asyncio.to_thread(complete, "wrong-token")
    with pytest.raises(openai.APIConnectionError):  # plaintext HTTP is not served
        await asyncio.to_thread(complete, TOKEN, "http")
    with pytest.raises(openai.APIConnectionError):  # no client certificate: the handshake fails
        await asyncio.to_thread(complete, TOKEN, "https", False)

"""API keys (health exempt), TLS and mTLS handshakes, against in-process servers."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.client import SpecserveClient, TlsConfig
from engine.server.app import ServerOptions
from engine.server.auth import ApiKeyInterceptor, key_id, load_api_key
from tests.server.certs import have_openssl, make_certs
from tests.server.helpers import InProcessServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if not have_openssl():
        pytest.skip("openssl CLI not found")
    return make_certs(tmp_path_factory.mktemp("certs"))


def _server(engine_config, **options) -> InProcessServer:
    return InProcessServer(engine_config, ServerOptions(host="127.0.0.1", port=0, **options))


def test_api_key_none_wrong_right_and_health_exempt(engine_config):
    with _server(engine_config, api_key=KEY) as srv:
        for api_key in (None, "wrong-key", KEY + "x"):
            with SpecserveClient(srv.target, api_key=api_key) as client:
                for call in (
                    lambda c: c.generate_complete("Hi", max_tokens=1),
                    lambda c: list(c.generate("Hi", max_tokens=1)),
                    lambda c: c.model_info(),
                ):
                    with pytest.raises(grpc.RpcError) as info:
                        call(client)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.health() == "SERVING"  # probes need no key
                assert client.health("") == "SERVING"
        with SpecserveClient(srv.target, api_key=KEY) as client:
            assert len(client.generate_complete("Hi", max_tokens=2).token_ids) == 2
            assert len([d for d in client.generate("Hi", max_tokens=2)]) >= 1
        assert "UNAUTHENTICATED" in srv.errors
        # Reflection is exempt too, so grpcurl can list services without a key.
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        with grpc.insecure_channel(srv.target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            response = next(iter(stub.ServerReflectionInfo(iter([request]))))
            names = {s.name for s in response.list_services_response.service}
            assert "specserve.v1.Generation" in names


def test_load_api_key(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    assert load_api_key(None, str(path)) == KEY
    assert load_api_key(KEY, None) == KEY and load_api_key(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        load_api_key(KEY, str(path))
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_api_key(None, str(path))


def test_an_api_key_file_holds_one_key_a_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY}\n\n  other-key  \n")
    assert load_api_key(None, str(path)) == (KEY, "other-key")
    path.write_text("\n \n")
    with pytest.raises(ValueError, match="empty"):
        load_api_key(None, str(path))
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeyInterceptor((KEY, ""))


def test_a_key_id_names_a_key_without_revealing_it():
    """Labels are scoped by key_id (tests/server/test_abort_scope.py): short, stable,
    one per key, and nothing of the key itself."""
    assert key_id(KEY) == key_id(KEY) != key_id(KEY + "x")
    assert key_id(KEY).startswith("key-") and len(key_id(KEY)) == 12
    assert KEY not in key_id(KEY)


def test_tls_handshake(engine_config, certs):
    options = dict(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key))
    with _server(engine_config, **options) as srv:
        tls = TlsConfig(ca_cert=str(certs.ca_cert), server_name="localhost")
        with SpecserveClient(srv.target, tls=tls) as client:
            assert client.health() == "SERVING"
            assert len(client.generate_complete("Hi", max_tokens=2).token_ids) == 2
        # A client that does not trust the server's CA fails the handshake.
        untrusted = TlsConfig(ca_cert=str(certs.other_ca_cert), server_name="localhost")
        with SpecserveClient(srv.target, tls=untrusted) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.model_info(timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plaintext against a TLS port fails too.
        with SpecserveClient(srv.target) as client, pytest.raises(grpc.RpcError):
            client.model_info(timeout=5)


def test_mtls_requires_a_client_certificate_from_the_ca(engine_config, certs):
    options = dict(
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        tls_client_ca=str(certs.ca_cert),
    )
    with _server(engine_config, **options) as srv:
        base = TlsConfig(ca_cert=str(certs.ca_cert), server_name="localhost")
        good = dataclasses.replace(
            base, client_cert=str(certs.client_cert), client_key=str(certs.client_key)
        )
        with SpecserveClient(srv.target, tls=good) as client:
            assert len(client.generate_complete("Hi", max_tokens=2).token_ids) == 2
        foreign = dataclasses.replace(
            base, client_cert=str(certs.other_client_cert), client_key=str(certs.other_client_key)
        )
        for tls in (base, foreign):  # no client certificate; one from another CA
            with grpc.secure_channel(
                srv.target, tls.credentials(), (("grpc.ssl_target_name_override", "localhost"),)
            ) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

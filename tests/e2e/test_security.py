"""Least privilege and TLS against real redis-server processes: the ACL file's users, certificates verified."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.request
from base64 import b64encode
from pathlib import Path

import pytest
import redis as redis_py
from queue_helpers import wait_until

from pagedq.config import Settings
from pagedq.config.celery_app import celery_config, make_celery
from pagedq.pipeline import Client
from pagedq.pipeline.local.redis_server import RedisServer, find_redis_server
from pagedq.pipeline.local.stack import Stack, settings_env
from pagedq.store.connection import redis_client
from pagedq.workers.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180


def acl_file_from_example(tmp_path: Path) -> tuple[Path, str, str]:
    """docker/redis-users.acl.example with fresh passwords filled in."""
    producer, worker = secrets.token_hex(24), secrets.token_hex(24)
    text = (ROOT / "docker" / "redis-users.acl.example").read_text()
    text = text.replace("#<sha256 of the producer password>", "#" + hashlib.sha256(producer.encode()).hexdigest())
    text = text.replace("#<sha256 of the worker password>", "#" + hashlib.sha256(worker.encode()).hexdigest())
    acl = tmp_path / "users.acl"
    acl.write_text("\n".join(ln for ln in text.splitlines() if ln and not ln.startswith("#")) + "\n")
    return acl, producer, worker


def get(url: str, auth: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": "Basic " + b64encode(auth.encode()).decode()})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return resp.read().decode()


def test_pipeline_with_the_acl_files_users_and_a_producer_confined_to_its_keys(tmp_path):
    acl, producer_pw, worker_pw = acl_file_from_example(tmp_path)
    server = RedisServer(tmp_path / "redis", write_run_file=False, acl_file=acl, acl_user=("pagedq-worker", worker_pw))
    server.start()
    try:
        port = server.port
        producer_url = f"redis://pagedq-producer:{producer_pw}@127.0.0.1:{port}/0"
        worker_url = f"redis://pagedq-worker:{worker_pw}@127.0.0.1:{port}/0"
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(host="127.0.0.1", port=port).get("pagedq:x")  # the default user is off
        settings = Settings(broker_url=worker_url, result_cache=False, kv_cache_memory="128MiB",
                            max_num_seqs=4)
        with Stack(settings, log_dir=tmp_path / "logs") as stack, \
                Client(settings.model_copy(update={"broker_url": producer_url}), producer_url) as client:
            job = client.submit(prompt="Least privilege means", max_tokens=6, temperature=0, ignore_eos=True)
            assert client.result(job, timeout=TIMEOUT)["usage"]["completion_tokens"] == 6
            job = client.submit(prompt="Streams flow", max_tokens=12, temperature=0, ignore_eos=True, stream=True)
            text = "".join(client.stream(job, timeout=TIMEOUT))
            assert text == client.result(job)["choices"][0]["text"] and text
            flower_checks_workers(settings, worker_url, tmp_path, stack)

            p = redis_client(producer_url)
            for command in (("FLUSHALL",), ("KEYS", "*"), ("SHUTDOWN",)):
                with pytest.raises(redis_py.exceptions.NoPermissionError):
                    p.execute_command(*command)
            for command in (("CONFIG", "SET", "dir", "/tmp"), ("DEBUG", "SLEEP", "0")):  # also renamed away
                with pytest.raises(redis_py.ResponseError, match="permission|unknown command"):
                    p.execute_command(*command)
            with pytest.raises(redis_py.exceptions.NoPermissionError):
                p.get("other:secret")  # outside the pagedq: prefix
            with pytest.raises(redis_py.exceptions.NoPermissionError):
                p.brpop([settings.key_prefix + "pagedq.preprocess"], timeout=1)  # producers cannot consume
            assert p.exists(client.names.job(job)) == 1
        for log in (tmp_path / "logs").glob("*.log"):
            text = log.read_text(errors="replace")
            assert producer_pw not in text and worker_pw not in text, f"a password leaked into {log.name}"
    finally:
        server.stop()


def flower_checks_workers(settings: Settings, url: str, tmp_path: Path, stack: Stack) -> None:
    """Flower on the worker user's URL, its auth from the environment (never in argv)."""
    port, auth = free_port(), f"admin:{secrets.token_hex(8)}"
    env = {**os.environ, **settings_env(settings), "PAGEDQ_BROKER_URL": url, "FLOWER_BASIC_AUTH": auth}
    log = open(tmp_path / "flower.log", "wb")
    flower = subprocess.Popen([sys.executable, "-m", "pagedq.pipeline.cli", "flower", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"

        def workers() -> dict | None:
            try:
                found = json.loads(get(f"{base}/api/workers?refresh=1", auth))
            except OSError:
                return None
            return found if any(c.hostname in found for c in stack.children) else None
        wait_until(workers, 90, 0.5, "Flower to list the workers")
        with pytest.raises(urllib.request.HTTPError):
            get(f"{base}/api/workers", "admin:wrong")
        cmdline = Path(f"/proc/{flower.pid}/cmdline").read_bytes().decode(errors="replace")
        assert auth.split(":")[1] not in cmdline and worker_url_password(url) not in cmdline
    finally:
        flower.terminate()
        flower.wait(30)
        log.close()


def worker_url_password(url: str) -> str:
    return url.split("@")[0].rsplit(":", 1)[1]


def test_flower_refuses_to_listen_beyond_loopback_without_auth(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    done = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "flower", "--address", "0.0.0.0",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "error:" in done.stderr and "Traceback" not in done.stderr


# --- TLS ------------------------------------------------------------------------------------------------------
def test_rediss_urls_verify_certificates_in_kombu_and_redis_py(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("placeholder")
    settings = Settings(broker_url="rediss://:pw@redis.example:6380/0", redis_ca_file=ca)
    conf = celery_config(settings, settings.broker_url)
    import ssl

    assert conf["broker_use_ssl"]["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert conf["broker_use_ssl"]["ssl_ca_certs"] == str(ca)
    from kombu import Connection

    make_celery(settings, settings.broker_url)
    transport = type(Connection(settings.broker_url, ssl=conf["broker_use_ssl"]).transport)
    assert transport.__module__ == "pagedq.store.transport", "the hardened transport is kept for rediss://"
    kwargs = redis_client(settings.broker_url, settings=settings).connection_pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_ca_certs"] == str(ca)
    assert kwargs["ssl_check_hostname"] is True and conf["broker_use_ssl"]["ssl_check_hostname"] is True


def tls_redis_server() -> str | None:
    """A redis-server binary built with TLS (the one on PATH, or $REDIS_TLS_SERVER), else None."""
    for candidate in (os.environ.get("REDIS_TLS_SERVER"), shutil.which("redis-server"), find_redis_server()):
        if not candidate:
            continue
        try:  # a build without TLS refuses the directive; one with TLS fails on the missing certificate instead
            probe = subprocess.run([candidate, "--port", "0", "--tls-port", str(free_port()), "--tls-cert-file",
                                    "/nonexistent"], capture_output=True, text=True, timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if "Bad directive" not in probe.stdout + probe.stderr:
            return candidate
    return None


def test_pipeline_over_tls_with_a_generated_ca(tmp_path, capsys):
    binary = tls_redis_server()
    if binary is None:
        with capsys.disabled():
            print("\nTLS pipeline test: no TLS-capable redis-server here (set REDIS_TLS_SERVER); "
                  "ran the configuration checks only")
        return
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    port, password = free_port(), secrets.token_hex(16)
    conf = tmp_path / "tls.conf"
    conf.write_text(f"port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {tmp_path / 'server.pem'}\n"
                    f"tls-key-file {tmp_path / 'server.pem'}\ntls-ca-cert-file {tmp_path / 'ca.pem'}\n"
                    f"tls-auth-clients no\nrequirepass {password}\ndir {tmp_path}\nappendonly yes\n")
    server = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"rediss://:{password}@127.0.0.1:{port}/0"
        settings = Settings(broker_url=url, redis_ca_file=tmp_path / "ca.pem", result_cache=False,
                            kv_cache_memory="128MiB", max_num_seqs=4)
        wait_until(lambda: _tls_ping(url, settings), 20, 0.2, "the TLS redis-server")
        untrusted = Settings(broker_url=url, result_cache=False)  # the system CAs do not know our CA
        with pytest.raises(redis_py.ConnectionError):
            redis_client(url, timeout_s=5, settings=untrusted).ping()
        with Stack(settings, log_dir=tmp_path / "logs"), Client(settings, url) as client:
            job = client.submit(prompt="Over TLS,", max_tokens=5, temperature=0, ignore_eos=True)
            assert client.result(job, timeout=TIMEOUT)["usage"]["completion_tokens"] == 5
        with capsys.disabled():
            print(f"\nTLS pipeline test: ran over TLS with {binary}")
    finally:
        server.terminate()
        server.wait(30)


def _tls_ping(url: str, settings: Settings) -> bool:
    try:
        return bool(redis_client(url, timeout_s=2, settings=settings).ping())
    except redis_py.RedisError:
        return False

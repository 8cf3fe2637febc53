"""A real S3-compatible server for the tests: moto's server mode (what s3fs's own test suite runs),
as a separate process on a local port, with request signing checked (IAM credentials made for the
session), and the fault-injecting proxy of s3_proxy.py in front of it when a test asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 240) -> None:
    """Long: a server that died ends the wait at once, and one alive is only slow to start on busy cores."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout}s (exit {proc.poll()})")


@dataclass
class S3Server:
    endpoint: str
    key: str
    secret: str
    proc: subprocess.Popen[bytes]
    proxies: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, endpoint: str | None = None, secret: str | None = None) -> dict[str, str]:
        """What a user sets: the standard AWS variables (no config file of the machine's user is read)."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": secret if secret is not None else self.secret,
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        }

    def fs(self):  # type: ignore[no-untyped-def]
        import s3fs

        return s3fs.S3FileSystem(
            key=self.key,
            secret=self.secret,
            client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            skip_instance_cache=True,
        )

    def proxy(self, tmp: Path, fail: str = "", times: int = 0, mode: str = "503") -> tuple[str, Path]:
        """A fault-injecting proxy in front of the server: (its endpoint, its request log)."""
        log, ready = tmp / f"proxy-{len(self.proxies)}.log", tmp / f"proxy-{len(self.proxies)}.port"
        p = subprocess.Popen(
            [sys.executable, str(HERE / "s3_proxy.py"), "--target", self.endpoint, "--fail", fail, "--times", str(times),
             "--mode", mode, "--log", str(log), "--ready", str(ready)],
        )  # fmt: skip
        self.proxies.append(p)
        deadline = time.monotonic() + 240
        while not (ready.exists() and ready.read_text().strip()) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{ready.read_text().strip()}"
        _wait_http(endpoint, p)
        return endpoint, log

    def stop(self) -> None:
        for p in [*self.proxies, self.proc]:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def start(port: int) -> S3Server:
    # This interpreter's moto (a moto_server found on PATH may belong to another Python whose
    # botocore computes signatures differently).
    env = dict(os.environ)
    # The first 3 requests (making a user, its policy and its key) are unauthenticated; every
    # request after them must be signed with a key the server knows.
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    _wait_http(endpoint + "/moto-api/", proc)
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    iam.create_user(UserName="aura")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="aura", PolicyName="all", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="aura")["AccessKey"]
    server = S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc)
    s3 = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=server.key, aws_secret_access_key=server.secret
    )
    for bucket in ("raw", "prep"):
        s3.create_bucket(Bucket=bucket)
    return server

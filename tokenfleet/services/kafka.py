"""A local Apache Kafka broker for development and tests, assembled from Maven Central.

One node in KRaft combined mode (broker and controller, static quorum), on free loopback
ports. The jars come from ``org.apache.kafka:kafka_2.13`` plus the log4j2 binding that its
dependency tree lacks (Kafka pins slf4j-api 1.7, so the binding is ``log4j-slf4j-impl``),
copied once by ``maven-dependency-plugin:copy-dependencies`` into ``CACHE/kafka-VERSION/lib``
through a Maven repository of the fetch's own (``CACHE/kafka-VERSION/m2``).

    tokenfleet kafka fetch     # download the jars (needs Java 17 and Maven)
    tokenfleet kafka start     # prints the bootstrap address, e.g. 127.0.0.1:40123
    tokenfleet kafka status    # the address of the running broker, or exit 1
    tokenfleet kafka stop
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

from tokenfleet.services.process import (
    CACHE,
    ServerProcess,
    ServiceError,
    free_port,
    read_address,
)

KAFKA_VERSION = "4.4.0"
LOG4J_VERSION = "2.25.3"
DEFAULT_HOME = CACHE / "run" / "kafka"

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>tokenfleet</groupId><artifactId>local-kafka</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId>
      <version>{kafka}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId>
      <version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""

_LOG4J2 = """Configuration:
  Appenders:
    Console: {name: STDOUT, PatternLayout: {pattern: "[%d] %p %m (%c)%n"}}
  Loggers:
    Root: {level: WARN, AppenderRef: [{ref: STDOUT}]}
    Logger:
      - {name: kafka.server.KafkaRaftServer, level: INFO}
"""


def jars_dir() -> Path:
    return CACHE / f"kafka-{KAFKA_VERSION}" / "lib"


def maven_repository() -> Path:
    """Where Maven keeps what it downloads for the fetch: a repository of the fetch's own,
    not ``~/.m2``, whose files Maven does not check again (``--strict-checksums`` checks
    downloads), so that a bad jar kept there failed every fetch; this one is removed
    when the jars do not match."""
    return CACHE / f"kafka-{KAFKA_VERSION}" / "m2"


JARS_SHA256 = Path(__file__).with_name(f"kafka-{KAFKA_VERSION}.sha256")
"""The SHA-256 of every jar the broker runs (``sha256sum`` format), taken when this
version was adopted: a fetch that brings other bytes, or other jars, is refused."""

FETCH_TIMEOUT_S = 900.0
"""The longest a fetch may take (about 90 MB from Maven Central, with Maven's plugins):
a stalled download failed nothing and ``tokenfleet kafka fetch`` or ``up`` hung."""


def fetch_jars() -> Path:
    """Download the broker's jars unless they are already cached; return their folder.
    Maven checks each download against the repository's checksum (``--strict-checksums``);
    the jars must then match ``JARS_SHA256``, or none is kept."""
    lib = jars_dir()
    marker = lib.parent / "complete"
    if marker.exists():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ServiceError("Maven (mvn) is needed to fetch Kafka's jars; install it first")
    lib.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(lib, ignore_errors=True)
    pom = lib.parent / "pom.xml"
    pom.write_text(_POM.format(kafka=KAFKA_VERSION, log4j=LOG4J_VERSION))
    command = [
        mvn,
        "-B",
        "-q",
        "--strict-checksums",
        "-f",
        str(pom),
        f"-Dmaven.repo.local={maven_repository()}",
        "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies",
        f"-DoutputDirectory={lib}",
        "-DincludeScope=runtime",
    ]
    print(f"Fetching Kafka {KAFKA_VERSION}'s jars from Maven Central (once)...", file=sys.stderr)
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=FETCH_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ServiceError(
            f"mvn did not fetch Kafka {KAFKA_VERSION} within {FETCH_TIMEOUT_S:g} s"
        ) from None
    if result.returncode != 0:
        raise ServiceError(f"mvn failed to fetch Kafka {KAFKA_VERSION}:\n{result.stdout[-3000:]}")
    check_pinned(lib)
    marker.touch()
    return lib


def check_pinned(lib: Path) -> None:
    """Raise where the jars in ``lib`` differ from ``JARS_SHA256``, after removing them
    and the Maven repository they came from, so that the next fetch downloads them afresh."""
    if problems := _unpinned(lib):
        shutil.rmtree(lib, ignore_errors=True)
        shutil.rmtree(maven_repository(), ignore_errors=True)
        raise ServiceError(
            f"Kafka's jars in {lib} differ from {JARS_SHA256}: {'; '.join(problems)}; removed "
            f"them and the Maven repository they came from, {maven_repository()}: fetch again"
        )


def _unpinned(lib: Path) -> list[str]:
    """How the jars in ``lib`` differ from ``JARS_SHA256`` (nothing where they match)."""
    pinned = dict(line.split()[::-1] for line in JARS_SHA256.read_text().splitlines() if line)
    fetched = {jar.name: hashlib.sha256(jar.read_bytes()).hexdigest() for jar in lib.glob("*.jar")}
    problems = [f"{name} missing" for name in sorted(pinned.keys() - fetched.keys())]
    problems += [f"{name} not pinned" for name in sorted(fetched.keys() - pinned.keys())]
    return problems + [
        f"{name} has SHA-256 {digest}, not {pinned[name]}"
        for name, digest in sorted(fetched.items())
        if name in pinned and digest != pinned[name]
    ]


class LocalKafka:
    """A one-node KRaft broker in ``home``; its data survives ``stop`` for a restart."""

    def __init__(self, home: Path, port: int | None = None) -> None:
        self.home = home
        self.port = port or free_port()
        self.controller_port = free_port()
        self._server = ServerProcess(home, self.bootstrap)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._server.log_path

    def start(self, *, detach: bool = False, timeout_s: float = 90.0) -> str:
        """Format storage on first start, launch, wait until it answers a metadata request."""
        if not shutil.which("java"):
            raise ServiceError("Java 17 or newer is needed to run the local Kafka broker")
        lib = fetch_jars()
        config = self._write_config()
        if not (self.home / "data" / "meta.properties").exists():
            self._java(
                lib,
                "kafka.tools.StorageTool",
                "format",
                "-t",
                _cluster_id(),
                "-c",
                str(config),
                "--ignore-formatted",
                run=True,
            )
        argv = self._java(lib, "kafka.Kafka", str(config), run=False)
        self._server.launch(argv, ready=self._answers, timeout_s=timeout_s, detach=detach)
        return self.bootstrap

    def stop(self) -> None:
        self._server.terminate()

    def _answers(self) -> bool:
        return metadata_broker_count("127.0.0.1", self.port) > 0

    def _write_config(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "log4j2.yaml").write_text(_LOG4J2)
        config = self.home / "server.properties"
        config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                    f"CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                    "inter.broker.listener.name=PLAINTEXT",
                    f"log.dirs={self.home / 'data'}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "auto.create.topics.enable=false",  # topics come from the catalog
                    "log.cleaner.backoff.ms=1000",
                    "",
                ]
            )
        )
        return config

    def _java(self, lib: Path, main: str, *args: str, run: bool) -> list[str]:
        argv = [
            "java",
            "-Xms256m",
            "-Xmx768m",
            "-XX:+UseG1GC",
            f"-Dlog4j2.configurationFile={self.home / 'log4j2.yaml'}",
            "-cp",
            f"{lib}/*",
            main,
            *args,
        ]
        if run:
            result = subprocess.run(argv, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise ServiceError(
                    f"{main} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
                )
        return argv


def running_bootstrap(home: Path | None = None) -> str | None:
    return read_address(home or DEFAULT_HOME)


def _cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes in URL-safe base64 without padding.

    One id in 64 would start with ``-``, which the storage tool's argument parser takes
    for an option; Kafka's own ``Uuid.randomUuid`` draws again in that case, and so do we.
    """
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def metadata_broker_count(host: str, port: int, timeout_s: float = 2.0) -> int:
    """Send a Metadata request (v4, the oldest Kafka 4 accepts); return how many brokers
    the answer lists, or 0 when nothing sensible answers."""
    client_id = b"tokenfleet-probe"
    body = struct.pack(">hhih", 3, 4, 1, len(client_id)) + client_id
    body += struct.pack(">ib", -1, 0)  # all topics, no auto-creation
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            header = _read_exactly(sock, 4 + 4 + 4 + 4)
    except OSError:
        return 0
    if len(header) < 16:
        return 0
    _size, correlation, _throttle, brokers = struct.unpack(">iiii", header)
    return brokers if correlation == 1 else 0


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data

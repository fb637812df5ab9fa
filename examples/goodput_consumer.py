"""Read TokenFleet's goodput stream with a plain Kafka client, outside the project.

Every message on ``tf.tables.goodput`` is a JSON envelope (``tokenfleet schemas export``
writes its JSON Schema, ``tf.table.goodput.json``) keyed by DC, holding the DC's goodput
table over a sliding window: per class and per tenant, the output tokens of requests that
met their objective (``goodput_tokens``, and per second: ``goodput_tokens_per_s``),
compliance and latency quantiles. This prints a line per class as tables arrive, and
passes over a record that is not such an envelope, saying so on stderr:

    python examples/goodput_consumer.py --bootstrap 127.0.0.1:9092

It needs only aiokafka (``pip install aiokafka``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiokafka import AIOKafkaConsumer


async def follow(bootstrap: str, dc: str | None, limit: int | None) -> None:
    consumer = AIOKafkaConsumer(
        "tf.tables.goodput", bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        seen = 0
        async for message in consumer:
            try:
                envelope = json.loads(message.value)
                schema, table = envelope["schema"], envelope["payload"]
            except (ValueError, TypeError, KeyError) as exc:
                where = f"{message.topic}[{message.partition}]@{message.offset}"
                print(f"skipped {where}: not an envelope ({exc!r})", file=sys.stderr)
                continue
            if not schema.startswith("tf.table.goodput/"):
                continue
            if dc is not None and table["dc"] != dc:
                continue
            for row in table["classes"]:
                print(
                    f"{table['dc']} {row['key']}: {row['goodput_tokens_per_s']:.1f} tokens/s "
                    f"of goodput, {row['compliance']:.1%} in time "
                    f"({row['completed']} completed, window ending {table['window_end']:.0f})",
                    flush=True,
                )
            seen += 1
            if limit is not None and seen >= limit:
                return
    finally:
        await consumer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default="127.0.0.1:9092", help="the Kafka broker")
    parser.add_argument("--dc", help="only this DC's tables")
    parser.add_argument("--tables", type=int, help="stop after this many tables")
    args = parser.parse_args()
    asyncio.run(follow(args.bootstrap, args.dc, args.tables))


if __name__ == "__main__":
    main()

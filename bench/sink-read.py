"""Reads a sink topic for bench/kafka: every message as `broker timestamp (ms) TAB payload`.

usage: sink-read.py BROKERS TOPIC IDS_FILE > sink.tsv

Reads every partition from its start until each event id of IDS_FILE has
been seen, or nothing new came for 10 s. It waits for the ids rather than
for the end of each partition because tansu reports a partition's end
short of its last batch. A Kafka client of its own (confluent-kafka) and
not kcat, which cannot talk to tansu.
"""
import json
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

brokers, topic, ids_file = sys.argv[1:4]
want = set(open(ids_file).read().split())
consumer = Consumer({
    "bootstrap.servers": brokers,
    "group.id": "skein-bench-sink-read",
    "enable.auto.commit": False,
    "fetch.wait.max.ms": 10,
})
parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
missing, last = set(want), time.time()
while missing and time.time() - last < 10:
    for m in consumer.consume(1000, 0.5):
        if m.error():
            continue
        last = time.time()
        payload = m.value().decode()
        try:
            missing.discard(json.loads(payload)["id"])
        except (ValueError, KeyError, TypeError):
            pass
        sys.stdout.write(f"{m.timestamp()[1]}\t{payload}\n")
consumer.close()
if missing:
    print(f"sink-read: {len(missing)} of {len(want)} live events not found in {topic}", file=sys.stderr)

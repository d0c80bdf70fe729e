"""The sample stream: msgpack + raw-frame codec, and the ZeroMQ producer/consumer with credit and acks.

Trainer side::

    consumer = StreamConsumer(StreamConfig(endpoint="tcp://127.0.0.1:5555", window=64), committed=ids)
    await consumer.start()
    group = await consumer.recv(timeout=60)   # a Group, de-duplicated by sample_id
    consumer.ack([group.sample_id])           # after the step that used it committed
    consumer.committed                        # checkpoint this set
    await consumer.close()

Rollouter side::

    producer = StreamProducer(StreamConfig(endpoint=...), producer_id="rollouter-0", unacked=restored)
    await producer.start()
    await producer.send(group)                # waits while out of credit
    producer.unacked                          # checkpoint these groups
    await producer.close()

`BlockingStreamConsumer` / `BlockingStreamProducer` offer the same calls to plain threads.
"""

from asyncrl.queue.blocking import BlockingStreamConsumer, BlockingStreamProducer
from asyncrl.queue.codec import CodecError, pack, unpack
from asyncrl.queue.consumer import ConsumerStats, StreamConsumer
from asyncrl.queue.producer import ProducerStats, StreamProducer
from asyncrl.queue.protocol import StreamConfig, StreamError, StreamTimeout

__all__ = [
    "BlockingStreamConsumer",
    "BlockingStreamProducer",
    "CodecError",
    "ConsumerStats",
    "ProducerStats",
    "StreamConfig",
    "StreamConsumer",
    "StreamError",
    "StreamProducer",
    "StreamTimeout",
    "pack",
    "unpack",
]

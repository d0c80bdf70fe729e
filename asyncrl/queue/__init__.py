"""The sample stream: msgpack + raw-frame codec, and the ZeroMQ producer/consumer with credit and acks."""

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

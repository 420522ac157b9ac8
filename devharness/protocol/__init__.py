"""The wire, in one place: what the engine, the executors, the workers, the server and the TUI say to each other.

- messages.py: the payloads (msgspec Structs only: step messages, outputs, worker state, control calls and the
  type of each one's reply, the /debug wire types);
- frames.py: the frames on the step channels (a step, a control call, exit; a reply) and the handshake of the TCP
  channel, and the codecs: one encoder, and one decoder per type that crosses a process boundary as msgpack;
- recording.py: the recording format on disk (a run of length-prefixed RecordedStep frames), which
  engine/record.py writes and reads.

No pickle anywhere on it (tests/test_network_code.py); nothing here imports torch or Ray.
"""

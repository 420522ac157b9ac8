"""The wire, in one place: what the engine, the executors, the workers, the server and the TUI say to each other.

- messages.py: the payloads (msgspec Structs only: step messages, outputs, worker state, control calls and the
  type of each one's reply, the /debug wire types);
- frames.py: the frames on the step channels (a step, a control call, exit; a reply), the handshake of the TCP
  channel and the length prefix of a frame on a byte stream, and the codecs: one encoder, and one decoder per type
  that crosses a process boundary as msgpack;
- json_codecs.py: one JSON decoder per /debug type that is read back (a server's answers, a bundle's files);
- recording.py: the recording format on disk (its files, manifest, the length-prefixed RecordedStep frames, the
  reader and the writers' encoding); engine/record.py decides what is recorded and when;
- errors.py: the typed failures an executor reports (WorkerError, WorkerDied), decided on by type above it.

No pickle anywhere on it (tests/test_network_code.py); nothing here imports torch or Ray, and nothing of devharness
but the plain data it carries (sampling_params.py, config.py).
"""

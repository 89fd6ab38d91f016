"""The error of a record that cannot be converted, shared by conversion.py and the modules of
its items (audio_records.py), so neither imports the other to raise it."""


class RecordError(ValueError):
  """A record that cannot be converted: the reason (a short key) and the message."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason

"""The replay buffer: admission, held groups, batches, the recording, crash resume."""

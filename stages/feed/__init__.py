"""The input of a training rank: shards -> decoded uint8 batches (stream reader or Ray Data), the decode
processes, the decoded tier, and the clocks that say where an epoch's time went."""

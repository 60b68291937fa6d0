"""The pure, I/O-free core of the training driver: prompts, samples, rewards, routing, the
staleness rule, the sample buffer and the batcher. The loops that call servers live beside it."""

"""`specserve train-draft`'s machinery: the target's own answers as data, the draft
model built from the target's first layers, and its training and export."""

//! Sampling: turns one row of logits into the next token.

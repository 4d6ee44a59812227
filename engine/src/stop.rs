//! Stop strings over a stream of generated text.

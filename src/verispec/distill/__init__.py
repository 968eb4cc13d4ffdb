"""Draft distillation: teach a small draft model to predict a target's greedy outputs (`verispec distill`)."""

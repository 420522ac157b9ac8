"""Process groups, the collectives over them, and the step-message channels between driver and workers."""

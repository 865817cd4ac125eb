"""A relay host's mates: the reader of the host's ring (:mod:`.reader`), the leader's board
they read (:mod:`.board`), and the notes they leave for the leader, who beats and acknowledges
for them on the store (:mod:`.notes`)."""

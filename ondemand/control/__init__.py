"""The controller: the pure decision core (the coordinator and its parts: slots, the start side,
the scheduler with its queue, victims and placement, the warmth policies) and its reaper, its
async edge (admission), its effects, the memory budget and the engines' measured footprint, the
start history."""

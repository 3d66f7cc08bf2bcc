package grader

// PendingWaiters reports how many Grade calls wait for rollout rid's answer.
func PendingWaiters(c *Client, rid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cl := c.pending[rid]; cl != nil {
		return cl.waiters
	}
	return 0
}

// BucketName is the key-value bucket that holds the gradings.
const BucketName = bucketName

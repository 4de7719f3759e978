//! Wake-ups for waiting retries over Redis pub/sub.
//!
//! One pub/sub connection per gateway, subscribed only to the channels of scopes that
//! some request is waiting on right now (so completions nobody waits for cost nothing
//! here). If the connection drops, it is re-made and every live channel re-subscribed;
//! meanwhile waiters simply fall back to polling the ledger.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{Notify, mpsc};

enum Command {
    Subscribe(String),
    Unsubscribe(String),
}

/// A channel some requests wait on: its wake-up, and how many wait.
struct Channel {
    notify: Arc<Notify>,
    waiting: usize,
}

type Waiters = Arc<Mutex<HashMap<String, Channel>>>;

/// Hands out "this channel fired" futures.
pub struct Notifier {
    commands: mpsc::UnboundedSender<Command>,
    waiters: Waiters,
}

impl Notifier {
    /// Starts the subscriber task against `url` (one node; in a cluster, any node
    /// receives every `PUBLISH`).
    pub fn start(url: String) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        let waiters: Waiters = Arc::default();
        tokio::spawn(run(url, rx, waiters.clone()));
        Self { commands, waiters }
    }

    /// Resolves when a message arrives on `channel`. However the future ends (fired,
    /// dropped by a timeout, or with the request it served), its interest ends with it:
    /// the last waiter of a channel unsubscribes.
    pub async fn fired(&self, channel: String) {
        let notify = {
            let mut waiters = self.waiters.lock().expect("waiters lock");
            let entry = waiters.entry(channel.clone()).or_insert_with(|| {
                let _ = self.commands.send(Command::Subscribe(channel.clone()));
                Channel {
                    notify: Arc::new(Notify::new()),
                    waiting: 0,
                }
            });
            entry.waiting += 1;
            entry.notify.clone()
        };
        let _guard = Unwatch {
            notifier: self,
            channel,
        };
        notify.notified().await;
    }

    /// Channels with at least one waiter now.
    pub fn watched(&self) -> usize {
        self.waiters.lock().expect("waiters lock").len()
    }
}

/// Counts one waiter out; the last one removes the channel and unsubscribes.
struct Unwatch<'a> {
    notifier: &'a Notifier,
    channel: String,
}

impl Drop for Unwatch<'_> {
    fn drop(&mut self) {
        let mut waiters = self.notifier.waiters.lock().expect("waiters lock");
        let Some(entry) = waiters.get_mut(&self.channel) else {
            return;
        };
        entry.waiting -= 1;
        if entry.waiting == 0 {
            waiters.remove(&self.channel);
            let _ = self
                .notifier
                .commands
                .send(Command::Unsubscribe(self.channel.clone()));
        }
    }
}

async fn run(url: String, mut commands: mpsc::UnboundedReceiver<Command>, waiters: Waiters) {
    loop {
        match session(&url, &mut commands, &waiters).await {
            Ok(()) => return, // the notifier was dropped
            Err(error) => {
                tracing::debug!(%error, "Redis pub/sub connection lost; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn session(
    url: &str,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    waiters: &Waiters,
) -> redis::RedisResult<()> {
    let client = redis::Client::open(url)?;
    let (mut sink, mut stream) = client.get_async_pubsub().await?.split();
    let live: Vec<String> = waiters
        .lock()
        .expect("waiters lock")
        .keys()
        .cloned()
        .collect();
    for channel in live {
        sink.subscribe(channel).await?;
    }
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                Some(Command::Subscribe(channel)) => sink.subscribe(channel).await?,
                Some(Command::Unsubscribe(channel)) => sink.unsubscribe(channel).await?,
                None => return Ok(()),
            },
            message = stream.next() => match message {
                Some(message) => {
                    let notify = waiters.lock().expect("waiters lock").get(message.get_channel_name()).map(|c| c.notify.clone());
                    if let Some(notify) = notify {
                        notify.notify_waiters();
                    }
                }
                None => return Err(redis::RedisError::from((redis::ErrorKind::Io, "pub/sub stream ended"))),
            },
        }
    }
}

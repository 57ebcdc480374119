// A person's NDK client (@nostr-dev-kit/ndk) for tenexd's end-to-end tests: a kind-1 thread.
// One JSON request on stdin, one JSON object on stdout.
//
//   {"relay": url, "secret": hex, "agent": hex, "reply_authors": [hex...], "note": text,
//    "follow_up": text, "timeout_ms": n}
//     publishes a kind-1 note p-tagging `agent`, waits for a kind-1 answer by one of `reply_authors`
//     that names the note in an `e` tag, replies to that answer with NDK's own `reply()` (NIP-10 for a
//     kind-1 parent), and waits for the answer naming that reply. Prints {note, answer, reply,
//     second_answer} as raw events (null for an answer that did not come in time).
import NDK, { NDKEvent, NDKPrivateKeySigner } from '@nostr-dev-kit/ndk'
import WebSocket from 'ws'

globalThis.WebSocket ??= WebSocket

async function readStdin() {
  const chunks = []
  for await (const chunk of process.stdin) chunks.push(chunk)
  return JSON.parse(Buffer.concat(chunks).toString('utf8'))
}

// The first kind-1 event by `authors` that names `eventId` in an `e` tag, or null after `ms`.
function answerTo(ndk, eventId, authors, ms) {
  return new Promise((resolve) => {
    const sub = ndk.subscribe(
      { kinds: [1], '#e': [eventId], authors, since: Math.floor(Date.now() / 1000) - 30 },
      { closeOnEose: false },
    )
    const timer = setTimeout(() => { sub.stop(); resolve(null) }, ms)
    sub.on('event', (event) => {
      clearTimeout(timer)
      sub.stop()
      resolve(event)
    })
  })
}

const req = await readStdin()
const timeout = req.timeout_ms ?? 10000
// Only the test's relay: NDK's outbox model would otherwise also dial its default public relays.
const ndk = new NDK({
  explicitRelayUrls: [req.relay],
  signer: new NDKPrivateKeySigner(req.secret),
  enableOutboxModel: false,
  autoConnectUserRelays: false,
})
await ndk.connect(5000)

const note = new NDKEvent(ndk, { kind: 1, content: req.note, tags: [['p', req.agent]] })
await note.sign()
const firstAnswer = answerTo(ndk, note.id, req.reply_authors, timeout)
await note.publish()
const answer = await firstAnswer

let reply = null
let secondAnswer = null
if (answer) {
  reply = answer.reply()
  reply.content = req.follow_up
  await reply.sign()
  const waiting = answerTo(ndk, reply.id, req.reply_authors, timeout)
  await reply.publish()
  secondAnswer = await waiting
}

const raw = (event) => (event ? event.rawEvent() : null)
process.stdout.write(JSON.stringify({
  note: raw(note), answer: raw(answer), reply: raw(reply), second_answer: raw(secondAnswer),
}) + '\n')
process.exit(0)

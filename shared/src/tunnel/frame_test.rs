use super::*;
use proptest::prelude::*;

fn encode(frame: &Frame) -> BytesMut {
    let mut out = BytesMut::new();
    frame.encode(&mut out);
    out
}

fn round_trip(frame: Frame) {
    let mut buf = encode(&frame);
    let len = buf.len();
    // Every proper prefix is "need more", consuming nothing.
    for cut in 0..len {
        let mut part = BytesMut::from(&buf[..cut]);
        assert_eq!(Frame::decode(&mut part), Ok(None), "prefix of {cut} bytes");
        assert_eq!(part.len(), cut);
    }
    assert_eq!(Frame::decode(&mut buf), Ok(Some(frame)));
    assert!(buf.is_empty());
}

fn hello() -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        role: Role::Agent,
        window: 4 << 20,
        max_streams: 100,
        token: "tok".into(),
    }
}

#[test]
fn data_exact_bytes() {
    let frame = Frame::Data {
        stream: StreamId(5),
        payload: Bytes::from_static(b"abc"),
    };
    assert_eq!(
        &encode(&frame)[..],
        b"\x11\x00\x00\x00\x00\x05\x00\x00\x00\x03abc"
    );
}

#[test]
fn hello_exact_bytes() {
    assert_eq!(
        &encode(&Frame::Hello(hello()))[..],
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x00\x12\
          LOKA\x00\x01\x01\x00\x40\x00\x00\x00\x00\x00\x64tok"
    );
}

#[test]
fn reset_and_window_update_exact_bytes() {
    let reset = Frame::Reset {
        stream: StreamId(3),
        code: ErrorCode::REFUSED,
        reason: "full".into(),
    };
    assert_eq!(
        &encode(&reset)[..],
        b"\x14\x00\x00\x00\x00\x03\x00\x00\x00\x06\x00\x04full"
    );
    let update = Frame::WindowUpdate {
        stream: StreamId(2),
        increment: 0x0102_0304,
    };
    assert_eq!(
        &encode(&update)[..],
        b"\x12\x00\x00\x00\x00\x02\x00\x00\x00\x04\x01\x02\x03\x04"
    );
}

#[test]
fn every_frame_type_round_trips() {
    round_trip(Frame::Hello(hello()));
    round_trip(Frame::HelloOk(HelloOk {
        version: 1,
        window: 65536,
        max_streams: 2048,
    }));
    round_trip(Frame::HelloReject {
        code: ErrorCode::BAD_TOKEN,
        reason: "unknown organization token".into(),
    });
    round_trip(Frame::Open {
        stream: StreamId(1),
        target: "org_42".into(),
    });
    round_trip(Frame::Data {
        stream: StreamId(7),
        payload: Bytes::from(vec![9; MAX_FRAME_BODY as usize]),
    });
    round_trip(Frame::WindowUpdate {
        stream: StreamId(7),
        increment: u32::MAX,
    });
    round_trip(Frame::Close {
        stream: StreamId(u32::MAX),
    });
    round_trip(Frame::Reset {
        stream: StreamId::TUNNEL,
        code: ErrorCode(999),
        reason: "é".into(),
    });
    round_trip(Frame::Ping(*b"12345678"));
    round_trip(Frame::Pong([0xff; 8]));
    round_trip(Frame::Drain);
}

#[test]
fn long_reason_is_cut_at_a_char_boundary() {
    let frame = Frame::Reset {
        stream: StreamId(1),
        code: ErrorCode::INTERNAL,
        reason: "é".repeat(MAX_TEXT_LEN), // 2048 bytes
    };
    let mut buf = encode(&frame);
    let Some(Frame::Reset { reason, .. }) = Frame::decode(&mut buf).unwrap() else {
        panic!("not a RESET");
    };
    assert_eq!(reason, "é".repeat(MAX_TEXT_LEN / 2));
}

#[test]
fn oversized_length_is_refused_from_the_header_alone() {
    let mut buf = BytesMut::from(&b"\x11\x00\x00\x00\x00\x01\x00\x01\x00\x01"[..]);
    assert_eq!(
        Frame::decode(&mut buf),
        Err(FrameError::BadLength {
            frame: FrameType::Data,
            len: 65537,
            min: 0,
            max: MAX_FRAME_BODY
        })
    );
    assert_eq!(
        Frame::decode(&mut buf).unwrap_err().to_string(),
        "DATA frame with a 65537-byte body (allowed: 0 to 65536 bytes)"
    );
}

#[test]
fn header_errors_name_the_frame_and_the_fault() {
    let cases: [(&[u8], FrameError, &str); 4] = [
        (
            b"\x7f\x00\x00\x00\x00\x00\x00\x00\x00\x00",
            FrameError::UnknownType { tag: 0x7f },
            "unknown tunnel frame type 0x7f",
        ),
        (
            b"\x20\x00\x00\x00\x00\x04\x00\x00\x00\x08",
            FrameError::BadStream {
                frame: FrameType::Ping,
                stream: StreamId(4),
            },
            "PING frame on agent stream 4, which that frame type may not use",
        ),
        (
            b"\x11\x00\x00\x00\x00\x00\x00\x00\x00\x00",
            FrameError::BadStream {
                frame: FrameType::Data,
                stream: StreamId(0),
            },
            "DATA frame on tunnel stream 0, which that frame type may not use",
        ),
        (
            b"\x21\x00\x00\x00\x00\x00\x00\x00\x00\x05",
            FrameError::BadLength {
                frame: FrameType::Pong,
                len: 5,
                min: 8,
                max: 8,
            },
            "PONG frame with a 5-byte body (allowed: 8 to 8 bytes)",
        ),
    ];
    for (bytes, err, text) in cases {
        assert_eq!(Frame::decode(&mut BytesMut::from(bytes)), Err(err.clone()));
        assert_eq!(err.to_string(), text);
    }
}

#[test]
fn body_errors_name_the_field() {
    let mut bad_magic = encode(&Frame::Hello(hello()));
    bad_magic[HEADER_LEN] = b'P';
    assert_eq!(
        Frame::decode(&mut bad_magic),
        Err(FrameError::Invalid {
            frame: FrameType::Hello,
            what: "magic (not a LokaDB tunnel)"
        })
    );
    let mut bad_role = encode(&Frame::Hello(hello()));
    bad_role[HEADER_LEN + 6] = 9;
    assert_eq!(
        Frame::decode(&mut bad_role).unwrap_err().to_string(),
        "HELLO frame with an invalid role"
    );
    let mut zero = BytesMut::from(&b"\x12\x00\x00\x00\x00\x01\x00\x00\x00\x04\x00\x00\x00\x00"[..]);
    assert_eq!(
        Frame::decode(&mut zero).unwrap_err().to_string(),
        "WINDOW_UPDATE frame with an invalid increment"
    );
    let mut not_utf8 = BytesMut::from(&b"\x10\x00\x00\x00\x00\x01\x00\x00\x00\x02\xff\xfe"[..]);
    assert_eq!(
        Frame::decode(&mut not_utf8).unwrap_err().to_string(),
        "OPEN frame with an invalid target"
    );
}

#[test]
fn unknown_flags_are_ignored() {
    let mut buf = BytesMut::from(&b"\x13\x80\x00\x00\x00\x09\x00\x00\x00\x00"[..]);
    assert_eq!(
        Frame::decode(&mut buf),
        Ok(Some(Frame::Close {
            stream: StreamId(9)
        }))
    );
}

#[test]
fn displays_name_stream_openers_and_codes() {
    assert_eq!(StreamId(0).to_string(), "tunnel stream 0");
    assert_eq!(StreamId(7).to_string(), "relay stream 7");
    assert_eq!(StreamId(8).to_string(), "agent stream 8");
    assert_eq!(ErrorCode::FLOW_CONTROL.to_string(), "FLOW_CONTROL");
    assert_eq!(ErrorCode(300).to_string(), "error code 300");
    assert_eq!(
        format!("{:?}", hello()),
        "Hello { version: 1, role: Agent, window: 4194304, max_streams: 100, token: <3 bytes> }"
    );
}

fn text_strategy() -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..40).prop_map(|c| c.into_iter().collect())
}

fn stream_strategy() -> impl Strategy<Value = StreamId> {
    (1..=u32::MAX).prop_map(StreamId)
}

pub(crate) fn frame_strategy() -> impl Strategy<Value = Frame> {
    let code = any::<u16>().prop_map(ErrorCode);
    prop_oneof![
        (
            any::<u16>(),
            any::<bool>(),
            1..=u32::MAX,
            any::<u32>(),
            text_strategy()
        )
            .prop_map(
                |(version, agent, window, max_streams, token)| Frame::Hello(Hello {
                    version,
                    role: if agent { Role::Agent } else { Role::Relay },
                    window,
                    max_streams,
                    token,
                })
            ),
        (any::<u16>(), 1..=u32::MAX, any::<u32>()).prop_map(|(version, window, max_streams)| {
            Frame::HelloOk(HelloOk {
                version,
                window,
                max_streams,
            })
        }),
        (code.clone(), text_strategy())
            .prop_map(|(code, reason)| Frame::HelloReject { code, reason }),
        (stream_strategy(), text_strategy())
            .prop_map(|(stream, target)| Frame::Open { stream, target }),
        (
            stream_strategy(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(stream, p)| Frame::Data {
                stream,
                payload: Bytes::from(p),
            }),
        (stream_strategy(), 1..=u32::MAX)
            .prop_map(|(stream, increment)| Frame::WindowUpdate { stream, increment }),
        stream_strategy().prop_map(|stream| Frame::Close { stream }),
        (any::<u32>(), code, text_strategy()).prop_map(|(s, code, reason)| Frame::Reset {
            stream: StreamId(s),
            code,
            reason,
        }),
        any::<[u8; 8]>().prop_map(Frame::Ping),
        any::<[u8; 8]>().prop_map(Frame::Pong),
        Just(Frame::Drain),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Arbitrary bytes never panic the decoder, and it never consumes a partial frame.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let mut buf = BytesMut::from(&bytes[..]);
        loop {
            let before = buf.len();
            match Frame::decode(&mut buf) {
                Ok(Some(_)) => prop_assert!(buf.len() < before),
                Ok(None) => {
                    prop_assert_eq!(buf.len(), before);
                    break;
                }
                Err(_) => break,
            }
        }
    }

    /// Arbitrary bytes behind a valid header exercise body parsing of every type.
    #[test]
    fn arbitrary_bodies_never_panic(
        tag in prop::sample::select(vec![
            HELLO_TAG, HELLO_OK_TAG, HELLO_REJECT_TAG, OPEN_TAG, DATA_TAG,
            WINDOW_UPDATE_TAG, CLOSE_TAG, RESET_TAG, PING_TAG, PONG_TAG, DRAIN_TAG,
        ]),
        stream in any::<u32>(),
        body in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut buf = BytesMut::new();
        buf.put_u8(tag);
        buf.put_u8(0);
        buf.put_u32(stream);
        buf.put_u32(body.len() as u32);
        buf.put_slice(&body);
        if let Ok(Some(frame)) = Frame::decode(&mut buf) {
            // Whatever decodes re-encodes to the same type and stream.
            prop_assert_eq!(frame.ty().tag(), tag);
            prop_assert_eq!(frame.stream(), StreamId(stream));
        }
    }

    /// A run of valid frames, delivered in arbitrary pieces, decodes to the same frames.
    #[test]
    fn split_frames_decode_identically(
        frames in proptest::collection::vec(frame_strategy(), 1..8),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let mut wire = BytesMut::new();
        for f in &frames {
            f.encode(&mut wire);
        }
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(wire.len() + 1)).collect();
        points.push(wire.len());
        points.sort_unstable();
        let mut input = BytesMut::new();
        let mut decoded = Vec::new();
        let mut at = 0;
        for p in points {
            input.extend_from_slice(&wire[at..p]);
            at = p;
            while let Some(f) = Frame::decode(&mut input).unwrap() {
                decoded.push(f);
            }
        }
        prop_assert!(input.is_empty());
        prop_assert_eq!(decoded, frames);
    }
}

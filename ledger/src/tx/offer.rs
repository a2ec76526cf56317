//! The offer actions. `OfferCreate`: a bonded operator offers experts of a model at a price
//! per reward unit until an expiry height; matching may then place orders on it. Offers are
//! not exclusive (one worker serves many backbones, each metered apart). `OfferWithdraw`:
//! the operator ends its open offer; every placement on it closes in the same transaction
//! and the orders they served are matched again at the block boundary.

use borsh::{BorshDeserialize, BorshSerialize};

use crate::amount::Amount;
use crate::keys::Address;
use crate::market::{self, Offer, OfferState, Selection, MAX_OPEN_OFFERS_PER_OPERATOR};
use crate::state::{Staged, State};

use super::{TxError, TxSignature};

/// What an operator offers.
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct NewOffer {
    pub model: String,
    pub experts: Selection,
    /// Base units per reward unit (`unit_bytes` of metered traffic).
    pub price: Amount,
    /// The offer expires at the end of this block.
    pub expiry_height: u64,
}

/// A model id as the market takes it: what genesis allows for pinned models.
pub(super) fn check_model_id(model: &str) -> Result<(), TxError> {
    if model.is_empty() || model.len() > market::MAX_MODEL_ID_LEN {
        return Err(TxError::BadModelId(model.chars().take(80).collect()));
    }
    Ok(())
}

/// On a format-2 chain, the model an offer or order names must be pinned (by id or name)
/// and its selection must lie within the model's shape; its pinned id is what the market
/// then stores, so an offer by name and an order by id match. On a format-1 chain, the name
/// as given (its market took any model id).
pub(super) fn pinned_model(
    state: &State,
    model: &str,
    experts: &Selection,
) -> Result<String, TxError> {
    let genesis = state.genesis();
    if genesis.params.format < 2 {
        return Ok(model.to_string());
    }
    let pin = genesis
        .pinned(model)
        .ok_or_else(|| TxError::NotAPinnedModel(model.chars().take(80).collect()))?;
    if let Some(shape) = pin.shape {
        let outside = experts
            .0
            .iter()
            .any(|r| r.layers.1 >= shape.layers || r.experts.1 >= shape.experts);
        if outside {
            return Err(TxError::SelectionOutsideModel {
                model: pin.name.clone(),
                layers: shape.layers,
                experts: shape.experts,
            });
        }
    }
    Ok(pin.id.clone())
}

/// The block being built: the one after the head.
pub(super) fn next_height(state: &State) -> u64 {
    state.height().saturating_add(1)
}

/// An end height must come after the block being built.
pub(super) fn check_future(state: &State, end_height: u64) -> Result<(), TxError> {
    if end_height <= next_height(state) {
        return Err(TxError::EndNotInFuture {
            end_height,
            height: next_height(state),
        });
    }
    Ok(())
}

pub(super) fn check_stateless_create(new: &NewOffer) -> Result<Vec<TxSignature>, TxError> {
    check_model_id(&new.model)?;
    new.experts.validate().map_err(TxError::BadSelection)?;
    Ok(Vec::new())
}

/// The operator is bonded as the chain asks and not jailed, holds fewer open offers than the
/// limit, and the expiry is ahead.
pub(super) fn check_create(
    state: &State,
    operator: &Address,
    new: &NewOffer,
) -> Result<(), TxError> {
    let genesis = state.genesis();
    if !genesis.bonds_required() {
        return Err(TxError::NoBonds);
    }
    let account = state.account(operator);
    if account.bonded < genesis.params.min_bond {
        return Err(TxError::InsufficientBond {
            bonded: account.bonded,
            needed: genesis.params.min_bond,
        });
    }
    if account.is_jailed(next_height(state)) {
        return Err(TxError::Jailed(*operator));
    }
    if state.market().open_offer_count(operator) >= MAX_OPEN_OFFERS_PER_OPERATOR {
        return Err(TxError::TooManyOpenOffers(MAX_OPEN_OFFERS_PER_OPERATOR));
    }
    pinned_model(state, &new.model, &new.experts)?;
    check_future(state, new.expiry_height)
}

pub(super) fn execute_create(
    staged: &mut Staged,
    operator: &Address,
    new: &NewOffer,
) -> Result<(), TxError> {
    let state = staged.state();
    let model = pinned_model(state, &new.model, &new.experts)?;
    staged.set_offer(Offer {
        id: state.market().next_offer_id(),
        operator: *operator,
        model,
        experts: new.experts.clone(),
        price: new.price,
        expiry_height: new.expiry_height,
        created_height: next_height(state),
        state: OfferState::Open,
        ended_height: 0,
    });
    Ok(())
}

/// The offer exists, is the sender's, and is open.
pub(super) fn check_withdraw(state: &State, operator: &Address, id: u64) -> Result<(), TxError> {
    let offer = state.market().offer(id).ok_or(TxError::UnknownOffer(id))?;
    if offer.operator != *operator {
        return Err(TxError::NotYours(*operator));
    }
    if offer.state != OfferState::Open {
        return Err(TxError::OfferNotOpen(id));
    }
    Ok(())
}

pub(super) fn execute_withdraw(staged: &mut Staged, id: u64) -> Result<(), TxError> {
    let height = next_height(staged.state());
    market::end_offer(staged, id, OfferState::Withdrawn, height)
}
